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

import pytest
import yaml

from rollout_parity import CorrectionConfig
from rollout_parity.doctor import framework_lines
from rollout_parity.testing.stack import need

CASES = {
    "tis_srs_k3+fp32": CorrectionConfig.preset("tis_srs_k3", fp32_lm_head=True),
    "tis_srs_k3, loosened": CorrectionConfig.preset("tis_srs_k3", rollout_rejection_threshold=0.03),
    "icepop": CorrectionConfig.preset("icepop"),
    "trl_default": CorrectionConfig.preset("trl_default"),
    "k1 range, two options, delta": CorrectionConfig(
        rollout_importance_sampling_mode="sequence_truncate",
        rollout_importance_sampling_sequence_reduction="product", rollout_rejection=["seq_mean_k1", "token_k3"],
        rollout_rejection_threshold=["0.5_2.0", 0.01], off_policy_sequence_mask_delta=0.3, fp32_lm_head=True),
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
