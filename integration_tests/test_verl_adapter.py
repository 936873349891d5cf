"""The verl adapter against the real verl 0.9.1 on CPU (issue 5).

* our loss, fetched through verl's ``get_policy_loss_fn``, equals the core and equals verl's
  own ``vanilla`` loss fed the same weights and mask, for every aggregation mode and with
  verl's global (data-parallel) normalisers;
* a Hydra compose of verl's own ``ppo_trainer`` config with ``+rollout_parity.*`` overrides
  validates into the expected ``CorrectionConfig`` and vLLM engine kwargs;
* the shared cross-framework batch gives the core's weights, mask, loss, gradient and
  metrics to 1e-6 (decoupled: driver hook + loss; bypass: loss alone);
* double correction raises; the patches are idempotent and reversible.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from rollout_parity.testing.stack import need

need("verl", extra="verl")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper as helper  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402

from rollout_parity import CorrectionConfig, compute_correction, policy_loss  # noqa: E402
from rollout_parity.adapters import verl as adapter  # noqa: E402
from rollout_parity.core.vllm_recipe import vllm_parity_kwargs  # noqa: E402

from .shared_batch import all_config_names, config_for, core_reference, load_expected, make_shared_batch  # noqa: E402

pytestmark = [pytest.mark.verl]

ATOL = 1e-6
VERL_CONFIG_DIR = os.path.join(os.path.dirname(core_algos.__file__), "..", "config")
BASE_OVERRIDES = ["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                  "actor_rollout_ref.rollout.name=vllm"]


def compose_verl(*overrides: str):
    with initialize_config_dir(config_dir=os.path.abspath(VERL_CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=[*BASE_OVERRIDES, *overrides])


@pytest.fixture(scope="module")
def actor_config():
    """A real verl ActorConfig (FSDPActorConfig) from verl's own defaults."""
    return omega_conf_to_dataclass(compose_verl().actor_rollout_ref.actor)


@pytest.fixture
def active():
    """Set the process's flags for a test, clear them afterwards."""
    def _set(cfg):
        adapter.set_active_config(cfg)
        return cfg
    yield _set
    adapter.set_active_config(None)


def token_advantages(batch):
    # verl's GRPO advantages are (B, T): the sequence score broadcast and masked.
    return batch.advantages.unsqueeze(-1) * batch.response_mask


def verl_loss(actor_config, *, old, cur, adv, mask, weights, agg="token-mean", global_info=None):
    actor_config.global_batch_info.clear()
    actor_config.global_batch_info.update(global_info or {})
    fn = core_algos.get_policy_loss_fn(adapter.LOSS_NAME)
    return fn(old_log_prob=old, log_prob=cur, advantages=adv, response_mask=mask.bool(), loss_agg_mode=agg,
              config=actor_config, rollout_is_weights=weights)


def through_verl(name, actor_config, active):
    """The decoupled verl path on the shared batch: driver hook, then the registered loss."""
    cfg = active(config_for(name))
    batch = make_shared_batch()
    proto = DataProto.from_dict(tensors={"old_log_probs": batch.old_logprobs.clone(),
                                         "rollout_log_probs": batch.rollout_logprobs.clone(),
                                         "response_mask": batch.response_mask.clone()})
    rc = OmegaConf.create({"rollout_is": None, "rollout_rs": None, "bypass_mode": False})
    proto, driver_metrics = helper.compute_rollout_correction_and_add_to_batch(proto, rc)
    weights = proto.batch.get("rollout_is_weights", None) if "rollout_is_weights" in proto.batch.keys() else None
    current = batch.fresh_current()
    loss, loss_metrics = verl_loss(actor_config, old=batch.old_logprobs, cur=current, adv=token_advantages(batch),
                                   mask=proto.batch["response_mask"], weights=weights)
    loss.backward()
    return cfg, proto, weights, loss, current.grad, driver_metrics, loss_metrics


# ----------------------------------------------------------------------------- registration

def test_loss_is_registered_through_verls_registry_and_patches_are_reversible():
    assert core_algos.get_policy_loss_fn("rollout_parity") is adapter.rollout_parity_policy_loss
    patched = helper.compute_rollout_correction_and_add_to_batch
    assert hasattr(patched, adapter._PATCH_MARK)
    adapter.install()  # idempotent: no double wrapping
    assert helper.compute_rollout_correction_and_add_to_batch is patched
    adapter.uninstall()
    try:
        assert "rollout_parity" not in core_algos.POLICY_LOSS_REGISTRY
        assert not hasattr(helper.compute_rollout_correction_and_add_to_batch, adapter._PATCH_MARK)
        import verl.utils.config as verl_config
        assert not hasattr(verl_config.validate_config, adapter._PATCH_MARK)
    finally:
        adapter.install()
    assert core_algos.get_policy_loss_fn("rollout_parity") is adapter.rollout_parity_policy_loss


def test_without_our_flags_verls_own_correction_runs_unchanged(active):
    batch = make_shared_batch()
    finite = torch.nan_to_num(batch.rollout_logprobs, nan=-1.0, neginf=-5.0)
    mask = batch.response_mask.clone()
    mask[4, 0] = 1.0  # verl refuses an all-empty row set only if all rows are empty; keep its input valid

    def proto():
        return DataProto.from_dict(tensors={"old_log_probs": batch.old_logprobs.clone(),
                                            "rollout_log_probs": finite.clone(), "response_mask": mask.clone()})

    rc = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": None, "rollout_rs_threshold": None}
    ours, metrics = helper.compute_rollout_correction_and_add_to_batch(proto(), rc)
    original = getattr(helper.compute_rollout_correction_and_add_to_batch, adapter._PATCH_MARK)
    theirs, their_metrics = original(proto(), rc)
    torch.testing.assert_close(ours.batch["rollout_is_weights"], theirs.batch["rollout_is_weights"])
    assert set(metrics) == set(their_metrics) and all(k.startswith("rollout_corr/") for k in metrics)


def test_loss_without_flags_is_a_clear_error(actor_config):
    batch = make_shared_batch()
    with pytest.raises(RuntimeError, match=adapter.ENV_CONFIG):
        verl_loss(actor_config, old=batch.old_logprobs, cur=batch.fresh_current(), adv=token_advantages(batch),
                  mask=batch.response_mask, weights=None)


# ----------------------------------------------------------------------------- loss equivalence

@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("global_info", [None, {"dp_size": 2, "batch_num_tokens": 113, "global_batch_size": 13,
                                                "loss_scale_factor": None},
                                         {"dp_size": 1, "batch_num_tokens": 60, "global_batch_size": 8,
                                          "loss_scale_factor": 7}])
def test_loss_equals_verls_vanilla_loss_given_the_same_weights(actor_config, active, agg, global_info):
    """Independent anchor: verl's own PPO loss with the same rollout_is_weights and mask."""
    active(CorrectionConfig.preset("verl_decoupled_token_is"))
    batch = make_shared_batch()
    old, adv = batch.old_logprobs, token_advantages(batch)
    rollout = torch.nan_to_num(batch.rollout_logprobs, nan=0.0, neginf=-30.0)
    weights = torch.exp((old - rollout).clamp(-20, 20)).clamp(max=2.0) * batch.response_mask
    cur_ours, cur_verl = batch.fresh_current(), batch.fresh_current()
    ours, _ = verl_loss(actor_config, old=old, cur=cur_ours, adv=adv, mask=batch.response_mask, weights=weights,
                        agg=agg, global_info=global_info)
    actor_config.global_batch_info.clear()
    actor_config.global_batch_info.update(global_info or {})
    theirs, _ = core_algos.compute_policy_loss_vanilla(old_log_prob=old, log_prob=cur_verl, advantages=adv,
                                                        response_mask=batch.response_mask.bool(), loss_agg_mode=agg,
                                                        config=actor_config, rollout_is_weights=weights)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=ATOL)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(cur_ours.grad, cur_verl.grad, atol=ATOL, rtol=ATOL)
    assert ours.abs() > 0


def test_dual_clip_follows_verls_clip_ratio_c(actor_config, active):
    active(CorrectionConfig())
    batch = make_shared_batch()
    cur = (batch.old_logprobs + 2.0).requires_grad_(True)  # ratio e^2 > clip_ratio_c=3 where A < 0
    adv = token_advantages(batch)
    ours, metrics = verl_loss(actor_config, old=batch.old_logprobs, cur=cur, adv=adv, mask=batch.response_mask,
                              weights=None)
    theirs, their_metrics = core_algos.compute_policy_loss_vanilla(
        old_log_prob=batch.old_logprobs, log_prob=cur, advantages=adv, response_mask=batch.response_mask.bool(),
        config=actor_config)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=ATOL)
    assert metrics["policy/pg_clipfrac_lower"] == pytest.approx(their_metrics["actor/pg_clipfrac_lower"], abs=ATOL)
    assert metrics["policy/pg_clipfrac_lower"] > 0


# ----------------------------------------------------------------------------- shared batch

DECOUPLED_EXACT = [n for n in all_config_names() if config_for(n).off_policy_sequence_mask_delta is None]
# C(r_ppo^rollout) needs rollout logprobs inside the loss, which verl 0.9.1 does not pass.
NOT_IN_VERL_DECOUPLED = {"rollout_correction/loss_contrib_rollout_pos", "rollout_correction/loss_contrib_rollout_neg"}


@pytest.mark.parametrize("name", DECOUPLED_EXACT)
def test_shared_batch_decoupled_matches_the_core(name, actor_config, active):
    ref = core_reference(name)
    frozen = load_expected()[name]
    cfg, proto, weights, loss, grad, driver_metrics, loss_metrics = through_verl(name, actor_config, active)
    mask = proto.batch["response_mask"]
    torch.testing.assert_close(mask, ref["mask"], atol=0, rtol=0)
    if cfg.rollout_importance_sampling_mode is not None:
        torch.testing.assert_close(weights, ref["weights"], atol=ATOL, rtol=ATOL)
    else:
        assert weights is None  # nothing to weight: verl's loss gets no rollout_is_weights
    torch.testing.assert_close(loss, ref["loss"], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(grad, ref["grad"], atol=ATOL, rtol=ATOL)
    assert loss.item() == pytest.approx(frozen["loss"], abs=ATOL)
    metrics = {**driver_metrics, **loss_metrics}
    expected = {k: v for k, v in ref["metrics"].items() if k not in NOT_IN_VERL_DECOUPLED}
    if not cfg.wants_metrics:
        expected = {k: v for k, v in expected.items() if not k.startswith("rollout_correction/")}
    else:
        # C(r_ppo^train) = -(pi_theta/pi_old - 1) A (paper eq. 5) is computed in the loss, over the
        # tokens the loss sees (after rejection; rollout NaN/-inf are invisible there): naive reference.
        batch = make_shared_batch()
        seen = ref["mask"].bool()
        contrib = -(torch.exp(batch.current_logprobs.detach() - batch.old_logprobs) - 1) * batch.advantages[:, None]
        n = seen.sum()
        expected["rollout_correction/loss_contrib_pos"] = (contrib * (seen & (batch.advantages[:, None] > 0))).sum().item() / n.item()
        expected["rollout_correction/loss_contrib_neg"] = (contrib * (seen & (batch.advantages[:, None] < 0))).sum().item() / n.item()
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=ATOL, rel=ATOL), key


def test_shared_batch_off_policy_mask_in_decoupled_verl_uses_pi_old_as_behaviour(actor_config, active):
    """The loss cannot see rollout logprobs in verl 0.9.1, so the behaviour policy is pi_old (DESIGN fallback)."""
    name = "off_policy_mask"
    cfg, proto, weights, loss, grad, driver_metrics, loss_metrics = through_verl(name, actor_config, active)
    batch = make_shared_batch()
    no_delta = core_reference_without_delta(cfg, batch)
    torch.testing.assert_close(weights, no_delta.weights, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(proto.batch["response_mask"], no_delta.mask, atol=0, rtol=0)
    # naive reference: delta_i = mean_t(old - current) over valid tokens, masked when > delta and A_i < 0
    valid = batch.response_mask.bool()
    drift = ((batch.old_logprobs - batch.current_logprobs.detach()) * valid).sum(-1) / valid.sum(-1).clamp_min(1)
    off = (drift > cfg.off_policy_sequence_mask_delta) & (batch.advantages < 0) & valid.any(-1)
    expected_mask = no_delta.mask.bool() & ~off.unsqueeze(-1)
    current = batch.fresh_current()
    correction = no_delta
    correction.mask = expected_mask.float() * batch.response_mask
    ref_loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=batch.old_logprobs,
                              advantages=batch.advantages, correction=correction, clip_ratio=0.2, clip_ratio_c=3.0)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(grad, current.grad, atol=ATOL, rtol=ATOL)
    assert loss_metrics["rollout_correction/off_policy_masked_frac"] == pytest.approx(
        off.sum().item() / valid.any(-1).sum().item(), abs=ATOL)


def core_reference_without_delta(cfg, batch):
    return compute_correction(cfg.replace(off_policy_sequence_mask_delta=None), old_logprobs=batch.old_logprobs,
                              rollout_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask)


BYPASS_CONFIGS = {
    "bypass_tis_srs_k3_rejection": dict(old_logprob_source="bypass", rollout_rejection=["seq_sum_k3"],
                                        rollout_rejection_threshold=0.05),
    "bypass_off_policy": dict(old_logprob_source="bypass", off_policy_sequence_mask_delta=0.02,
                              log_rollout_offpolicy_metrics=True),
}


@pytest.mark.parametrize("name", sorted(BYPASS_CONFIGS))
def test_shared_batch_bypass_matches_the_core(name, actor_config, active):
    """Bypass: verl copies rollout_log_probs into old_log_probs; the loss does the rest."""
    cfg = active(CorrectionConfig(**BYPASS_CONFIGS[name]))
    batch = make_shared_batch()
    # Under bypass the NaN rollout logprob *is* pi_old inside the PPO ratio: policy_loss
    # treats it as a neutral token (ratio 1), so the loss stays finite.
    # core, as a user of the core would call it
    current_ref = batch.fresh_current()
    out = compute_correction(cfg, rollout_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask,
                             advantages=batch.advantages, current_logprobs=current_ref)
    ref_loss, ref_metrics = policy_loss(cfg, current_logprobs=current_ref, advantages=batch.advantages,
                                        correction=out, clip_ratio=0.2, clip_ratio_c=3.0)
    ref_loss.backward()
    # verl: old_log_probs := rollout_log_probs (verl's own bypass switch), then our loss
    current = batch.fresh_current()
    loss, metrics = verl_loss(actor_config, old=batch.rollout_logprobs, cur=current, adv=token_advantages(batch),
                              mask=batch.response_mask, weights=None)
    loss.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(current.grad, current_ref.grad, atol=ATOL, rtol=ATOL)
    assert set(metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=ATOL, rel=ATOL), key
    assert out.mask.sum() < batch.response_mask.sum()  # the config really masked something


# ----------------------------------------------------------------------------- Hydra config

def test_hydra_compose_of_verls_config_validates_into_correction_config():
    config = compose_verl(
        "+rollout_parity.rollout_importance_sampling_mode=token_truncate",
        "+rollout_parity.rollout_rejection=[seq_sum_k3]",
        "+rollout_parity.rollout_rejection_threshold=0.001",
        "+rollout_parity.fp32_lm_head=true",
    )
    cfg = adapter.configure_verl(config)
    try:
        assert cfg == CorrectionConfig.preset("tis_srs_k3", fp32_lm_head=True)
        rollout = config.actor_rollout_ref.rollout
        assert OmegaConf.to_container(rollout.engine_kwargs.vllm) == vllm_parity_kwargs(fp32_lm_head=True)
        assert rollout.engine_kwargs.vllm.hf_overrides.head_dtype == "float32"
        assert rollout.enable_prefix_caching is False and rollout.logprobs_mode == "processed_logprobs"
        assert rollout.calculate_log_probs is True
        assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "rollout_parity"
        assert config.actor_rollout_ref.model.external_lib == "rollout_parity.adapters.verl"
        env = config.ray_kwargs.ray_init.runtime_env.env_vars[adapter.ENV_CONFIG]
        assert CorrectionConfig.from_dict(json.loads(env)) == cfg
        assert adapter.active_config() == cfg
        # verl still turns the rewritten blocks into its dataclasses
        actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        assert actor.policy_loss.loss_mode == "rollout_parity"
        assert omega_conf_to_dataclass(config.actor_rollout_ref.rollout).engine_kwargs["vllm"]["logprobs_mode"] \
            == "processed_logprobs"
        assert config.algorithm.rollout_correction.bypass_mode is False
        # configuring twice changes nothing
        snapshot = OmegaConf.to_container(config)
        adapter.configure_verl(config)
        assert OmegaConf.to_container(config) == snapshot
    finally:
        adapter.set_active_config(None)


def test_hydra_preset_and_bypass():
    config = compose_verl("+rollout_parity.preset=verl_decoupled_token_is",
                          "actor_rollout_ref.model.external_lib=my_models")
    try:
        assert adapter.configure_verl(config) == CorrectionConfig.preset("verl_decoupled_token_is")
        assert list(config.actor_rollout_ref.model.external_lib) == ["my_models", "rollout_parity.adapters.verl"]
        config = compose_verl("+rollout_parity.old_logprob_source=bypass",
                              "+rollout_parity.rollout_rejection=[token_k3]",
                              "+rollout_parity.rollout_rejection_threshold=0.5")
        cfg = adapter.configure_verl(config)
        assert cfg.old_logprob_source == "bypass"
        # verl's own switch for pi_old := pi_rollout, with none of verl's corrections on
        rc = config.algorithm.rollout_correction
        assert rc.bypass_mode is True and rc.rollout_is is None and rc.rollout_rs is None
        assert "hf_overrides" not in config.actor_rollout_ref.rollout.engine_kwargs.vllm
    finally:
        adapter.set_active_config(None)


VALID_RUN = ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
             "algorithm.adv_estimator=grpo", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "trainer.n_gpus_per_node=1"]


def test_verls_patched_validate_config_configures_then_validates():
    """What main_ppo.main calls at start: ours first, then verl's own checks pass on the rewrite."""
    import verl.utils.config as verl_config
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    assert hasattr(verl_config.validate_config, adapter._PATCH_MARK)
    config = compose_verl("+rollout_parity.preset=tis_srs_k3", "+rollout_parity.fp32_lm_head=true", *VALID_RUN)
    try:
        verl_config.validate_config(config, use_reference_policy=need_reference_policy(config),
                                    use_critic=need_critic(config))
        assert adapter.active_config() == CorrectionConfig.preset("tis_srs_k3", fp32_lm_head=True)
    finally:
        adapter.set_active_config(None)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "rollout_parity"


def test_a_real_main_ppo_command_line_rejects_a_bad_flag_at_start(tmp_path):
    """``python -m verl.trainer.main_ppo ... +rollout_parity.<bad>`` fails before Ray starts."""
    import subprocess
    import sys

    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES=adapter.MODULE, HYDRA_FULL_ERROR="1")
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *BASE_OVERRIDES, *VALID_RUN,
         "+rollout_parity.rollout_importance_sampling_mode=token_clip", f"hydra.run.dir={tmp_path}"],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "rollout_importance_sampling_mode: unknown mode 'token_clip'" in proc.stderr
    assert "ray init kwargs" not in proc.stdout  # stopped before run_ppo


@pytest.mark.parametrize("override, flag", [
    ("+rollout_parity.rollout_importance_sampling_mode=token_clip", "rollout_importance_sampling_mode"),
    ("+rollout_parity.rollout_importance_sampling_threshold=-1", "rollout_importance_sampling_threshold"),
    ("+rollout_parity.rollout_rejection=[seq_sum_k4]", "rollout_rejection"),
    ("+rollout_parity.rollout_importance_sampling_treshold=2", "rollout_importance_sampling_treshold"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.enable_prefix_caching=true", "enable_prefix_caching"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "loss_mode"),
    ("actor_rollout_ref.actor.loss_agg_mode=token-sum", "token-sum"),
])
def test_bad_flags_fail_at_start_naming_the_flag(override, flag):
    config = compose_verl("+rollout_parity.rollout_importance_sampling_mode=token_truncate", override) \
        if not override.startswith("+rollout_parity.") else compose_verl(override)
    with pytest.raises(ValueError, match=flag):
        adapter.configure_verl(config)
    assert adapter.active_config() is None


def test_no_block_leaves_verls_config_untouched():
    config = compose_verl()
    before = OmegaConf.to_container(config)
    assert adapter.configure_verl(config) is None
    assert OmegaConf.to_container(config) == before


# ----------------------------------------------------------------------------- double correction

@pytest.mark.parametrize("override", [
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_rs=seq_sum_k3",
    "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
    "algorithm.rollout_correction.bypass_mode=true",
])
def test_double_correction_is_refused_at_start(override):
    config = compose_verl("+rollout_parity.rollout_importance_sampling_mode=token_truncate", override)
    with pytest.raises(ValueError, match="double correction|bypass_mode"):
        adapter.configure_verl(config)


def test_double_correction_is_refused_on_the_driver_too(active):
    active(CorrectionConfig.preset("verl_decoupled_token_is"))
    batch = make_shared_batch()
    proto = DataProto.from_dict(tensors={"old_log_probs": batch.old_logprobs, "rollout_log_probs":
                                         batch.rollout_logprobs, "response_mask": batch.response_mask})
    with pytest.raises(ValueError, match="double correction"):
        helper.compute_rollout_correction_and_add_to_batch(proto, {"rollout_is": "token", "rollout_rs": None})


# ----------------------------------------------------------------------------- fp32 lm_head hook

def test_fp32_lm_head_is_applied_when_the_actor_model_is_built(active):
    """FSDPEngine._build_module (load, before LoRA/QAT/FSDP) is wrapped; the head then returns fp32."""
    import transformers
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from rollout_parity.core.fp32_head import is_fp32_lm_head
    from rollout_parity.testing.tiny_model import build_tiny_model

    assert hasattr(FSDPEngine.__dict__["_build_module"], adapter._PATCH_MARK)
    path = build_tiny_model()

    class FakeEngine:  # what the wrapper reads of verl's engine
        model_config = type("ModelConfig", (), {"model_type": "language_model"})()

    def build(fp32):
        active(CorrectionConfig(fp32_lm_head=fp32))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
        return adapter._wrap_build_module(lambda self: model)(FakeEngine())

    try:
        with_head, without = build(True), build(False)
    finally:
        adapter.set_active_config(None)
    hidden = torch.randn(2, 3, with_head.config.hidden_size, dtype=torch.bfloat16)
    assert is_fp32_lm_head(with_head) and with_head.get_output_embeddings()(hidden).dtype == torch.float32
    assert not is_fp32_lm_head(without) and without.get_output_embeddings()(hidden).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- baselines (verl#6362)

def grpo_batch(seed=0, groups=2, n=4, T=6):
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 2 - 0.05
    rollout = old + torch.randn(B, T, generator=g) * 0.01
    rollout[1] += 0.4  # whole sequences far off: seq_sum_k3 rejects them
    rollout[6] -= 0.5
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.tensor([1.0, 5.0, 0.0, 1.0, 0.0, 1.0, -3.0, 1.0])
    uid = [f"prompt{i // n}" for i in range(B)]
    return old, rollout, mask, rewards, uid


def naive_grpo(scores, mask, uid, kept_rows, eps=1e-6):
    adv = torch.zeros_like(mask)
    for i in range(len(uid)):
        if not kept_rows[i]:
            continue
        siblings = torch.stack([scores[j] for j in range(len(uid)) if uid[j] == uid[i] and kept_rows[j]])
        mean, std = siblings.mean(), siblings.std() if len(siblings) > 1 else torch.tensor(1.0)
        if len(siblings) == 1:
            mean = torch.tensor(0.0)
        adv[i] = (scores[i] - mean) / (std + eps) * mask[i]
    return adv


def test_rejected_sequences_leave_verls_grpo_baselines(active):
    """Driver hook, then verl's own compute_advantage (GRPO): rejected siblings do not move the baseline."""
    import numpy as np
    from verl.trainer.ppo.ray_trainer import compute_advantage

    cfg = active(CorrectionConfig(rollout_rejection=["seq_sum_k3"], rollout_rejection_threshold=0.05))
    old, rollout, mask, rewards, uid = grpo_batch()

    def proto():
        p = DataProto.from_dict(tensors={"old_log_probs": old.clone(), "rollout_log_probs": rollout.clone(),
                                         "response_mask": mask.clone(), "token_level_rewards": rewards.clone()},
                                non_tensors={"uid": np.array(uid, dtype=object)})
        return p

    ours, _ = helper.compute_rollout_correction_and_add_to_batch(proto(), {"rollout_is": None, "rollout_rs": None})
    kept_rows = ours.batch["response_mask"].bool().any(-1)
    assert kept_rows.tolist() == [True, False, True, True, True, True, False, True]
    ours = compute_advantage(ours, adv_estimator="grpo", num_repeat=4)
    expected = naive_grpo(rewards.sum(-1), ours.batch["response_mask"], uid, kept_rows)
    torch.testing.assert_close(ours.batch["advantages"], expected, atol=1e-5, rtol=1e-5)

    # the leak the hook closes: verl's own path keeps the rejected rewards in the group statistics
    original = getattr(helper.compute_rollout_correction_and_add_to_batch, adapter._PATCH_MARK)
    theirs, _ = original(proto(), adapter.verl_equivalent(cfg))
    theirs = compute_advantage(theirs, adv_estimator="grpo", num_repeat=4)
    torch.testing.assert_close(theirs.batch["response_mask"], ours.batch["response_mask"])
    assert not torch.allclose(theirs.batch["advantages"], expected, atol=1e-3)


def test_a_rejected_reward_token_leaves_the_score(active):
    """Token-level rejection of the final (reward) token: the outcome reward is masked like the token."""
    import numpy as np
    from verl.trainer.ppo.ray_trainer import compute_advantage

    active(CorrectionConfig(rollout_rejection=["token_k2"], rollout_rejection_threshold=0.02))
    old, rollout, mask, rewards, uid = grpo_batch(1)
    rollout = old.clone()
    last = mask.sum(-1).long() - 1
    rollout[0, last[0]] += 1.0  # only row 0's reward token is off
    proto = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                         "token_level_rewards": rewards}, non_tensors={"uid": np.array(uid, dtype=object)})
    out, _ = helper.compute_rollout_correction_and_add_to_batch(proto, {"rollout_is": None, "rollout_rs": None})
    new_mask = out.batch["response_mask"]
    assert new_mask[0, last[0]] == 0 and new_mask.sum() == mask.sum() - 1
    out = compute_advantage(out, adv_estimator="grpo", num_repeat=4)
    scores = rewards.sum(-1)
    scores[0] = 0.0  # its reward token was rejected
    expected = naive_grpo(scores, new_mask, uid, torch.ones(len(uid), dtype=torch.bool))
    torch.testing.assert_close(out.batch["advantages"], expected, atol=1e-5, rtol=1e-5)


def test_verls_v1_driver_step_runs_our_correction_before_grpo():
    """verl's own PPOTrainer._compute_advantage (V1 trainer), TransferQueue stood in by a dict."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "integration_tests.support.verl_v1_driver"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT_JSON ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT_JSON "))
    assert result["patched"]  # the module-level import in trainer_base sees our hook
    assert result["mask_equal"] and result["weights_max_diff"] < 1e-6
    assert result["rejected_rows"] == [1, 6]
    assert result["adv_max_diff"] < 1e-5  # GRPO over the kept siblings only
    assert result["metrics_equal"] and "rollout_correction/rejected_seq_frac" in result["metric_keys"]


def test_missing_verl_is_an_import_error_naming_the_extra():
    import subprocess
    import sys

    code = ("import sys; sys.modules['verl'] = None\n"
            "try:\n    import rollout_parity.adapters.verl\nexcept ImportError as e:\n    print('MSG', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install rollout-parity[verl]" in proc.stdout, proc.stderr[-2000:]


def test_the_example_command_line_passes_verls_validation():
    """examples/verl_ppo.sh: its overrides compose, configure and pass verl's own validate_config."""
    import re
    import shlex
    from pathlib import Path

    import verl.utils.config as verl_config
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    script = (Path(__file__).resolve().parents[1] / "examples" / "verl_ppo.sh").read_text()
    command = script[script.index("python3 -m verl.trainer.main_ppo"):].split('"$@"')[0]
    command = command.replace("$DATA", "/data/gsm8k").replace("$MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    overrides = [tok for tok in shlex.split(re.sub(r"\\\n", " ", command))[3:]]
    assert overrides[-1] == "+rollout_parity.preset=tis_srs_k3"
    with initialize_config_dir(config_dir=os.path.abspath(VERL_CONFIG_DIR), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    try:
        verl_config.validate_config(config, use_reference_policy=need_reference_policy(config),
                                    use_critic=need_critic(config))
        assert adapter.active_config() == CorrectionConfig.preset("tis_srs_k3")
    finally:
        adapter.set_active_config(None)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "rollout_parity"
