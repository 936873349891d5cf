"""The doctor's copy-pasteable lines, parsed back through each framework's own config path.

``rollout_parity.doctor.framework_lines`` writes, for one ``CorrectionConfig``, the verl Hydra
overrides, the TRL command-line flags and the NeMo RL YAML. Each is read back the way the
framework reads it, and must give the same flags:

* verl: Hydra composes verl's own ``ppo_trainer`` config with the overrides;
  ``adapters.verl.correction_config_from_verl`` reads the ``rollout_parity`` block.
* TRL: ``trl.TrlParser`` parses the flags into ``adapters.trl.ParityGRPOConfig``.
* NeMo RL: the YAML's ``loss_fn`` block builds ``adapters.nemo_rl.RolloutParityLossFn`` through
  ``from_nemo_config`` (its guard line resolves under the hook and stops NeMo RL's reading
  without), with NeMo RL's own loss from the v0.7.0 anchor, and its
  ``policy`` block is what ``nemo_rl_generation_config`` puts where NeMo RL reads the recipe.
"""

from __future__ import annotations

import os
import shlex
import textwrap
from pathlib import Path

import pytest
import yaml

from rollout_parity import CorrectionConfig
from rollout_parity.doctor import framework_lines
from rollout_parity.testing.stack import need

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "tis_srs_k3+fp32": CorrectionConfig.preset("tis_srs_k3", fp32_lm_head=True),
    "tis_srs_k3, loosened": CorrectionConfig.preset("tis_srs_k3", rollout_rejection_threshold=0.03),
    "icepop": CorrectionConfig.preset("icepop"),
    "trl_default": CorrectionConfig.preset("trl_default"),
    "k1 range, two options, delta": CorrectionConfig(
        rollout_importance_sampling_mode="sequence_truncate",
        rollout_importance_sampling_sequence_reduction="product", rollout_rejection=["seq_mean_k1", "token_k3"],
        rollout_rejection_threshold=["0.5_2.0", 0.01], off_policy_sequence_mask_delta=0.3, fp32_lm_head=True),
    "k1 pair": CorrectionConfig(rollout_rejection=["seq_mean_k1"], rollout_rejection_threshold=[0.95, 1.05]),
}


@pytest.mark.verl
@pytest.mark.parametrize("name", list(CASES))
def test_verl_hydra_overrides_compose_into_the_same_flags(name):
    need("verl", extra="verl")
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo import core_algos

    from rollout_parity.adapters.verl import correction_config_from_verl

    cfg = CASES[name]
    overrides = [line.strip() for line in framework_lines(cfg)["verl"].split("\\\n")]
    config_dir = os.path.abspath(os.path.join(os.path.dirname(core_algos.__file__), "..", "config"))
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.rollout.name=vllm", *overrides])
    assert correction_config_from_verl(config) == cfg


@pytest.mark.trl
@pytest.mark.parametrize("name", list(CASES))
def test_trl_flags_parse_into_the_same_flags(name, tmp_path):
    need("trl", extra="trl")
    from trl import TrlParser

    from rollout_parity.adapters.trl import ParityGRPOConfig

    cfg = CASES[name]
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none",
            *shlex.split(framework_lines(cfg)["trl"])]
    args = TrlParser(ParityGRPOConfig).parse_args_and_config(argv)[0]
    assert args.correction_config() == cfg


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", list(CASES))
def test_nemo_rl_yaml_builds_the_same_loss_and_generation_config(name):
    from omegaconf import OmegaConf
    from omegaconf.errors import UnsupportedInterpolationType

    from integration_tests.support.nemo_anchor import ANCHORS, skip_unless_available
    from rollout_parity.adapters.nemo_rl import (RolloutParityLossFn, check_nemo_rl_vllm_kwargs, launched,
                                                 nemo_rl_generation_config)

    skip_unless_available(("v0.7.0",))
    cfg = CASES[name]
    doc = OmegaConf.create(yaml.safe_load(framework_lines(cfg)["nemo_rl"]))
    with pytest.raises(UnsupportedInterpolationType, match="rollout_parity"):  # NeMo RL's reading, no hook
        OmegaConf.to_container(doc, resolve=True)
    with ANCHORS.activate("v0.7.0"), launched():  # rollout-parity launch's hook
        OmegaConf.to_container(doc, resolve=True)
        loss_fn = RolloutParityLossFn.from_nemo_config(doc.loss_fn)
    # NeMo RL refuses fp32_lm_head (its trainer head stays bf16): the lines leave it out and say so.
    assert loss_fn.correction == cfg.replace(fp32_lm_head=False)
    assert framework_lines(cfg)["nemo_rl"].startswith("# fp32_lm_head left out") == cfg.fp32_lm_head
    policy = OmegaConf.to_container(doc.policy)
    assert policy == nemo_rl_generation_config()["policy"]
    check_nemo_rl_vllm_kwargs(policy["generation"]["vllm_kwargs"])
    assert policy["generation"]["vllm_cfg"]["logprobs_mode"] == "processed_logprobs"
    assert "hf_config_overrides" not in policy


# ----------------------------------------------------------------------------- the lines as printed


def _printed(cfg: CorrectionConfig) -> tuple[CorrectionConfig, dict[str, list[str]]]:
    """``format_recommendation``'s text for a report evaluated with ``cfg``, cut at its headings.

    The report's rows make the fp32 step matter (so the lines carry ``fp32_lm_head``) and carry no
    length advice (so the lines keep ``cfg``'s rejection): the lines must give back ``expected``."""
    from rollout_parity.doctor import format_recommendation, recommend

    def row(name, d, **extra):
        return dict(row=name, delta_abs_mean=d, clipped_frac=0.0, rejected_token_frac=0.0, rejected_seq_frac=0.0,
                    tokens_per_s=1.0, vs_a=1.0, **extra)

    report = dict(rows=[row("a", 5e-2), row("b", 4e-3), row("c", 4e-3), row("d", 1e-3)],
                  correction_preset="custom", correction_config=cfg.to_dict(), sampling=dict(max_tokens=8),
                  lengths=dict(response_length=None, advice={}))
    report["recommendation"] = recommend(report)
    blocks: dict[str, list[str]] = {}
    current = None
    for line in format_recommendation(report).splitlines():
        if line.startswith(("verl (", "TRL (", "TRL, an unmodified", "NeMo RL (")):
            current = line.split(" (")[0].split(",")[0] + (" launch" if "unmodified" in line else "")
            blocks[current] = [line]
        elif current is not None and line.strip():
            blocks[current].append(line)
    return cfg.replace(fp32_lm_head=True, log_rollout_offpolicy_metrics=False), blocks


@pytest.mark.verl
@pytest.mark.trl
@pytest.mark.parametrize("name", list(CASES))
def test_every_printed_line_runs_under_the_command_it_names(name, tmp_path):
    """Each block of the doctor's printed recommendation, pasted as printed, through the real parser of the
    command it names: verl's Hydra config, TRL's ``TrlParser``, ``rollout-parity launch`` (its script
    exists), and the NeMo RL YAML through the block reader ``rollout-parity launch`` hooks into NeMo RL."""
    need("verl", extra="verl")
    need("trl", extra="trl")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from trl import TrlParser
    from verl.trainer.ppo import core_algos

    from rollout_parity.adapters.nemo_rl import split_loss_config
    from rollout_parity.adapters.trl import ParityGRPOConfig
    from rollout_parity.adapters.verl import correction_config_from_verl
    from rollout_parity.launcher import correction_from_args, parse_args

    expected, blocks = _printed(CASES[name])
    assert list(blocks) == ["verl", "TRL", "TRL launch", "NeMo RL"]
    # verl: "add to python -m verl.trainer.main_ppo ...": the override lines, continued with backslashes
    assert "python -m verl.trainer.main_ppo" in blocks["verl"][0]
    overrides = shlex.split(" ".join(line.rstrip("\\") for line in blocks["verl"][1:]))
    config_dir = os.path.abspath(os.path.join(os.path.dirname(core_algos.__file__), "..", "config"))
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.rollout.name=vllm", *overrides])
    assert correction_config_from_verl(config) == expected
    # TRL: a script parsing ParityGRPOConfig with TrlParser
    (trl_line,) = blocks["TRL"][1:]
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none", *shlex.split(trl_line)]
    assert TrlParser(ParityGRPOConfig).parse_args_and_config(argv)[0].correction_config() == expected
    # rollout-parity launch FLAGS script.py: the flags, then the script untouched
    (launch_line,) = blocks["TRL launch"][1:]
    words = shlex.split(launch_line)
    assert words[:2] == ["rollout-parity", "launch"]
    args = parse_args(words[2:])
    assert correction_from_args(args) == expected
    assert args.target == ["examples/trl_grpo.py"] and (ROOT / args.target[0]).is_file()
    # NeMo RL: the YAML to merge into the recipe, read as rollout-parity launch's hook reads loss_fn
    assert "NeMo RL's own examples/run_grpo.py" in blocks["NeMo RL"][0]
    doc = OmegaConf.create(yaml.safe_load(textwrap.dedent("\n".join(blocks["NeMo RL"][1:]))))
    assert split_loss_config(doc.loss_fn)[0] == expected.replace(fp32_lm_head=False)  # NeMo RL refuses it, said so
