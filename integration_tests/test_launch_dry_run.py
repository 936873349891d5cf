"""``rollout-parity launch --dry-run``: what the adapters would do to a verl or TRL command line, and nothing else.

verl: the real CLI on ``-m verl.trainer.main_ppo`` with the documented overrides (docs/verl.md's first block)
prints the shared flags ``correction_config_from_verl`` reads from verl's own Hydra-composed ``ppo_trainer``
config (composed here, independently), the keys the adapter changed and the recipe in the vLLM engine kwargs;
in process, Ray's ``ray.init`` is never called (``import verl`` imports Ray, so only starting it can be
checked), the adapter's refusal is its own line with exit 2, and launcher flags are refused by name with the
overrides to write. TRL: TRL's own ``trl/scripts/grpo.py`` with a model and a dataset that cannot load here
(offline) exits 0 with the flags printed, so it stopped before loading either; a script that builds no config
exits 1; a mistyped shared flag exits 2.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_parity.core.config import CorrectionConfig
from integration_tests.support.dry_run_report import json_items as _json_items, sections as _sections
from rollout_parity.launcher import main as launch

REPO = Path(__file__).resolve().parents[1]
VERL_MAIN = "verl.trainer.main_ppo"
#: What a user's own command line has besides our flags (docs/verl.md: "<your usual overrides>").
USUAL = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.strategy=fsdp"]
#: A model and a dataset that cannot be loaded here: offline, and no such model exists.
NO_MODEL = "rollout-parity-tests/no-such-model"


def _documented_overrides() -> list[str]:
    """The ``+rollout_parity.*`` overrides of docs/verl.md's first command (README's verl block is a part of it)."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "docs" / "verl.md").read_text(), re.DOTALL).group(1)
    overrides = re.findall(r"\+rollout_parity\.\w+=\S+", block)
    readme = re.findall(r"\+rollout_parity\.\w+=\S+", (REPO / "README.md").read_text().split("## verl", 1)[1]
                        .split("```", 2)[1])
    assert overrides and set(readme) <= set(overrides)
    return overrides


def _cli(*argv: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "rollout_parity.cli", "launch", *argv], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout)


def _compose(overrides: list[str]):
    """verl's own ppo_trainer config, composed with Hydra's API from verl's config directory."""
    from hydra import compose, initialize_config_dir
    import verl.trainer

    config_dir = os.path.join(os.path.dirname(verl.trainer.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@pytest.mark.verl
def test_verl_dry_run_prints_the_flags_verl_config_reads_and_the_recipe(monkeypatch, capsys, tmp_path):
    """In process (the CLI's own process is TRL's test below): ``launch`` as ``rollout-parity launch`` calls it."""
    from rollout_parity.testing.stack import need

    need("verl", extra="verl")
    from rollout_parity.adapters.verl import correction_config_from_verl

    overrides = [*USUAL, *_documented_overrides()]
    assert "+rollout_parity.fp32_lm_head=true" in overrides
    monkeypatch.chdir(tmp_path)
    code = launch(["--dry-run", "-m", VERL_MAIN, *overrides])
    out, err = capsys.readouterr()
    assert code == 0, out + err[-3000:]
    report = _sections(out)
    expected = correction_config_from_verl(_compose(overrides))
    assert expected is not None and expected.fp32_lm_head
    assert _json_items(report["shared flags"]) == expected.to_dict()
    engine = _json_items(report["vLLM engine kwargs"])
    assert engine["logprobs_mode"] == "processed_logprobs"
    assert engine["enable_prefix_caching"] is False and engine["async_scheduling"] is False
    assert engine["hf_overrides"] == {"head_dtype": "float32"}
    changed = report["verl config changed by the adapter"]
    assert changed["actor_rollout_ref.rollout.enable_prefix_caching"] == "true -> false"  # verl's own default was on
    assert changed["actor_rollout_ref.model.external_lib"] == 'null -> "rollout_parity.adapters.verl"'
    assert "actor_rollout_ref.rollout.name" not in changed  # only what changed is listed


@pytest.mark.verl
def test_verl_dry_run_never_starts_ray_and_refuses_with_the_adapters_line(monkeypatch, capsys):
    from rollout_parity.testing.stack import need

    need("verl", extra="verl")
    import ray

    from rollout_parity.adapters import verl as adapter

    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append((a, k)))
    env_before = os.environ.get(adapter.ENV_CONFIG)
    flag = "+rollout_parity.rollout_importance_sampling_mode=token_truncate"
    assert launch(["--dry-run", "-m", VERL_MAIN, *USUAL, flag]) == 0
    out = capsys.readouterr().out
    assert started == [] and not ray.is_initialized()
    assert os.environ.get(adapter.ENV_CONFIG) == env_before  # the flags are not left active in this process
    engine = _json_items(_sections(out)["vLLM engine kwargs"])
    assert engine["logprobs_mode"] == "processed_logprobs" and "hf_overrides" not in engine  # no fp32_lm_head
    # a refusal is the adapter's own line (the one Hydra prints for main_ppo), exit 2
    bad = "+rollout_parity.rollout_importance_sampling_mod=token_truncate"
    with pytest.raises(ValueError) as refused:
        adapter.configure_verl(_compose([*USUAL, bad]))
    assert launch(["--dry-run", "-m", VERL_MAIN, *USUAL, bad]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"rollout-parity: {refused.value}"
    assert started == []
    # the launcher's own flags mean nothing to verl: refused by name, with the overrides to write
    assert launch(["--dry-run", "--fp32_lm_head", "--preset", "tis_srs_k3", "-m", VERL_MAIN, *USUAL]) == 2
    err = capsys.readouterr().err
    assert "--preset, --fp32_lm_head" in err
    assert "+rollout_parity.preset=tis_srs_k3 +rollout_parity.fp32_lm_head=true" in err


@pytest.mark.verl
def test_verl_dry_run_of_an_sglang_rollout_prints_sglangs_recipe(monkeypatch, capsys, tmp_path):
    from rollout_parity.testing.stack import need

    need("verl", extra="verl")
    from rollout_parity.engines.sglang.recipe import sglang_parity_kwargs

    monkeypatch.chdir(tmp_path)
    overrides = ["actor_rollout_ref.rollout.name=sglang", "+rollout_parity.fp32_lm_head=true",
                 "+rollout_parity.rollout_importance_sampling_mode=token_truncate"]
    assert launch(["--dry-run", "-m", VERL_MAIN, *overrides]) == 0
    report = _sections(capsys.readouterr().out)
    assert "vLLM engine kwargs" not in report
    assert _json_items(report["SGLang engine kwargs"]) == sglang_parity_kwargs(fp32_lm_head=True)


@pytest.mark.trl
def test_trl_dry_run_stops_before_model_and_dataset(tmp_path):
    from rollout_parity.testing.stack import need

    need("trl", extra="trl")
    proc = _cli("--dry-run", "--rollout_importance_sampling_mode", "token_truncate", "-m", "trl.scripts.grpo",
                "--model_name_or_path", NO_MODEL, "--dataset_name", "trl-lib/DeepMath-103K", "--use_vllm",
                "--use_cpu", "true", "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    # exit 0 with a model and a dataset that cannot load here (offline, no such model): neither was loaded
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "stopped when TrlParser.parse_args_and_config returned" in proc.stdout
    report = _sections(proc.stdout)
    assert _json_items(report["shared flags"]) == \
        CorrectionConfig(rollout_importance_sampling_mode="token_truncate").to_dict()
    trl_config = _json_items(report["GRPOConfig"])
    assert trl_config["use_vllm"] is True and trl_config["vllm_mode"] == "colocate"
    engine = _json_items(report["vLLM engine kwargs"])
    assert engine["logprobs_mode"] == "processed_logprobs"
    assert engine["enable_prefix_caching"] is False and engine["async_scheduling"] is False
    assert "hf_overrides" not in engine  # fp32_lm_head is off
    assert not (tmp_path / "out").exists()


@pytest.mark.trl
def test_trl_dry_run_of_a_script_without_a_config_exits_1(tmp_path, capsys):
    from rollout_parity.testing.stack import need

    need("trl", extra="trl")
    script = tmp_path / "no_config.py"
    script.write_text("print('ran')\n")
    assert launch(["--dry-run", str(script)]) == 1
    captured = capsys.readouterr()
    assert captured.out.strip() == "ran" and "without building a GRPOConfig or a GRPOTrainer" in captured.err


def test_mistyped_shared_flag_exits_2(tmp_path):
    proc = _cli("--dry-run", "--rollout_importance_sampling_mod", "token_truncate", "-m", "trl.scripts.grpo",
                "--model_name_or_path", NO_MODEL, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "unknown option --rollout_importance_sampling_mod (did you mean '--rollout_importance_sampling_mode'?)" \
        in proc.stderr
