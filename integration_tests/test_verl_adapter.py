"""The verl adapter against the real verl on CPU (issues 5, 10, 11).

* the apply/revert/is_applied trio: identity, idempotence, the lookup sites, all or nothing,
  a missing private name or a stranger's wrapper refused by name;
* a Hydra compose of verl's own ``ppo_trainer`` config with ``+rollout_parity.*`` overrides
  validates into the expected ``CorrectionConfig`` and rewrites only what it must (the user's
  ``loss_mode`` stays), and what cannot be expressed is refused by name;
* the shared cross-framework batch through verl's own loss gives the core's weights, mask,
  loss, gradient and metrics to 1e-6 (decoupled: driver hook + loss; bypass: both routes);
* rejected tokens and sequences leave verl's GRPO baselines; verl's V1 driver step runs it;
* verl and TRL 1.16 side by side: verl's TRL detection is off only where TRL lacks the class.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout_parity.testing.stack import need

need("verl", extra="verl")

from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper as helper  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402

from rollout_parity import CorrectionConfig, compute_correction, policy_loss  # noqa: E402
from rollout_parity import framework_api as _compat  # noqa: E402
from rollout_parity.adapters import verl as adapter  # noqa: E402
from rollout_parity.adapters._patching import MARK, owner_and_name  # noqa: E402
from rollout_parity.adapters.verl import actor, patches  # noqa: E402
from rollout_parity.adapters.verl.compat import has_v1_trainer  # noqa: E402
from rollout_parity.core.metric_names import verl_names  # noqa: E402
from rollout_parity.core.sampler import SamplerSettings  # noqa: E402
from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs  # noqa: E402

from rollout_parity.check.shared_batch import all_config_names, config_for, core_reference, load_expected, make_shared_batch  # noqa: E402
from .support.verl_configs import BASE_OVERRIDES, compose_verl, flags  # noqa: E402,F401 (flags: a fixture)
from .support.verl_configs import actor_config as verl_actor_config  # noqa: E402
from .support.verl_equivalent import verl_equivalent  # noqa: E402

pytestmark = [pytest.mark.verl]

ATOL = 1e-6
REPO = Path(__file__).resolve().parents[1]
#: The core's policy metrics and where a verl run logs them: verl's loss's own metrics of the same formula
#: (``actor/ppo_kl``, the clip fractions), computed over the mask we hand it; we never repeat them.
LOSS_METRICS = {"policy/ppo_k1_mean": "actor/ppo_kl", "policy/pg_clipfrac": "actor/pg_clipfrac",
                "policy/pg_clipfrac_lower": "actor/pg_clipfrac_lower"}


@pytest.fixture(scope="module")
def actor_config():
    """A real verl ActorConfig (FSDPActorConfig) from verl's own defaults."""
    return verl_actor_config()


@pytest.fixture
def reverted():
    """Run a test with the adapter reverted; re-applied afterwards whatever happened."""
    adapter.revert()
    try:
        yield
    finally:
        adapter.revert()
        adapter.apply()


def token_advantages(batch):
    # verl's GRPO advantages are (B, T): the sequence score broadcast and masked.
    return batch.advantages.unsqueeze(-1) * batch.response_mask


def verl_loss(actor_config, *, old, cur, adv, mask, weights, agg="token-mean", global_info=None, mode="vanilla"):
    """verl's loss as its ppo_loss fetches it (through the registry lookup we wrap)."""
    actor_config.global_batch_info.clear()
    actor_config.global_batch_info.update(global_info or {})
    fn = core_algos.get_policy_loss_fn(mode)
    return fn(old_log_prob=old, log_prob=cur, advantages=adv, response_mask=mask.bool(), loss_agg_mode=agg,
              config=actor_config, rollout_is_weights=weights)


def driver(old, rollout, mask, rc=None):
    proto = DataProto.from_dict(tensors={"old_log_probs": old.clone(), "rollout_log_probs": rollout.clone(),
                                         "response_mask": mask.clone()})
    rc = rc or {"rollout_is": None, "rollout_rs": None, "bypass_mode": False}
    proto, metrics = helper.compute_rollout_correction_and_add_to_batch(proto, rc)
    weights = proto.batch["rollout_is_weights"] if "rollout_is_weights" in proto.batch.keys() else None
    return proto, weights, metrics


# ============================================================================= the trio

EAGER = [p for p in patches.PATCH_POINTS if p.eager]


def _held(point):
    """What the owner of ``point`` holds itself (a class's own __dict__ entry, a module's name)."""
    import importlib

    owner, name = owner_and_name(importlib.import_module(point.module), point.attr)
    return vars(owner).get(name)


def test_apply_wraps_every_eager_name_once_and_revert_restores_the_very_originals():
    import verl.workers.utils.losses as losses

    assert adapter.is_applied()
    patched = {p.dotted: _held(p) for p in EAGER}
    originals = {k: v.__wrapped__ for k, v in patched.items()}
    for dotted, fn in patched.items():
        assert getattr(fn, MARK) is True, dotted
        assert not hasattr(originals[dotted], MARK), dotted  # __wrapped__ is verl's, not a wrapper
    assert losses.get_policy_loss_fn is core_algos.get_policy_loss_fn  # the lookup site has the same wrapper
    assert losses.ppo_loss.__wrapped__.__module__ == "verl.workers.utils.losses"
    adapter.apply()  # idempotent: the very same objects
    assert {p.dotted: _held(p) for p in EAGER} == patched
    adapter.revert()
    try:
        assert not adapter.is_applied()
        for point in EAGER:
            assert _held(point) is originals[point.dotted], point.dotted
        assert losses.get_policy_loss_fn is originals["verl.trainer.ppo.core_algos.get_policy_loss_fn"]
        assert not hasattr(losses.ppo_loss, MARK)
        assert patches.patcher.hook not in sys.meta_path
    finally:
        adapter.apply()
    assert adapter.is_applied()


def test_a_missing_private_name_is_refused_by_name_and_nothing_stays_patched(reverted, monkeypatch):
    import verl.utils.config as verl_config

    monkeypatch.delattr(core_algos, "get_policy_loss_fn")
    with pytest.raises(_compat.FrameworkAPIError, match=r"verl\.trainer\.ppo\.core_algos\.get_policy_loss_fn"):
        adapter.apply()
    assert not hasattr(verl_config.validate_config, MARK)  # patched first, undone
    assert not hasattr(helper.compute_rollout_correction_and_add_to_batch, MARK)


def test_a_strangers_wrapper_is_not_stacked_on(reverted, monkeypatch):
    original = core_algos.get_policy_loss_fn

    @functools.wraps(original)
    def someone_elses(name):
        return original(name)

    monkeypatch.setattr(core_algos, "get_policy_loss_fn", someone_elses)
    with pytest.raises(RuntimeError, match="already replaced by .*someone_elses.*refusing to stack"):
        adapter.apply()
    assert core_algos.get_policy_loss_fn is someone_elses


def test_an_untested_verl_version_warns_once_naming_the_tested_range(reverted, monkeypatch):
    monkeypatch.setattr(_compat, "installed_version", lambda dists: "0.10.7")
    with pytest.warns(_compat.UntestedFrameworkVersionWarning, match=r">=0\.8\.0,<0\.10"):
        adapter.apply()


def test_a_run_checks_every_required_name_before_it_starts(monkeypatch):
    import verl.workers.utils.padding as padding

    monkeypatch.delattr(padding, "response_to_nested")
    config = compose_verl("+rollout_parity.rollout_importance_sampling_mode=token_truncate")
    with pytest.raises(_compat.FrameworkAPIError, match=r"verl\.workers\.utils\.padding\.response_to_nested"):
        adapter.configure_verl(config)
    assert adapter.active_config() is None
    assert set(adapter.REQUIRED_VERL_NAMES) >= {p.dotted for p in patches.PATCH_POINTS if not p.optional}


def test_without_our_flags_every_wrapper_passes_through(flags):
    assert core_algos.get_policy_loss_fn("gspo") is core_algos.POLICY_LOSS_REGISTRY["gspo"]
    batch = make_shared_batch()
    finite = torch.nan_to_num(batch.rollout_logprobs, nan=-1.0, neginf=-5.0)
    rc = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": None, "rollout_rs_threshold": None}
    ours, _, metrics = driver(batch.old_logprobs, finite, batch.response_mask, rc)
    original = helper.compute_rollout_correction_and_add_to_batch.__wrapped__
    proto = DataProto.from_dict(tensors={"old_log_probs": batch.old_logprobs.clone(), "rollout_log_probs": finite.clone(),
                                         "response_mask": batch.response_mask.clone()})
    theirs, their_metrics = original(proto, rc)
    torch.testing.assert_close(ours.batch["rollout_is_weights"], theirs.batch["rollout_is_weights"])
    assert set(metrics) == set(their_metrics) and all(k.startswith("rollout_corr/") for k in metrics)


# ============================================================================= Hydra config

def test_hydra_compose_of_verls_config_validates_into_correction_config():
    config = compose_verl(
        "+rollout_parity.rollout_importance_sampling_mode=token_truncate",
        "+rollout_parity.rollout_rejection=[seq_sum_k3]",
        "+rollout_parity.rollout_rejection_threshold=0.001",
        "+rollout_parity.fp32_lm_head=true",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
    )
    cfg = adapter.configure_verl(config)
    try:
        assert cfg == CorrectionConfig.preset("tis_srs_k3", fp32_lm_head=True)
        assert adapter.correction_config_from_verl(config) == cfg  # the public parse, e.g. for the doctor
        rollout = config.actor_rollout_ref.rollout
        assert OmegaConf.to_container(rollout.engine_kwargs.vllm) == vllm_parity_kwargs(fp32_lm_head=True)
        assert rollout.engine_kwargs.vllm.hf_overrides.head_dtype == "float32"
        assert rollout.enable_prefix_caching is False and rollout.logprobs_mode == "processed_logprobs"
        assert rollout.calculate_log_probs is True
        assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"  # the user's loss, unchanged
        assert config.actor_rollout_ref.model.external_lib == "rollout_parity.adapters.verl"
        env = config.ray_kwargs.ray_init.runtime_env.env_vars
        assert CorrectionConfig.from_dict(json.loads(env[adapter.ENV_CONFIG])) == cfg
        assert adapter.ENV_SAMPLER not in env  # top_k/top_p off: no sampler-aware pass
        assert adapter.MODULE in env["VERL_USE_EXTERNAL_MODULES"].split(",")  # every Ray process imports us
        assert adapter.active_config() == cfg
        actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)  # verl's dataclasses still build
        assert actor.policy_loss.loss_mode == "gspo"
        assert omega_conf_to_dataclass(config.actor_rollout_ref.rollout).engine_kwargs["vllm"]["logprobs_mode"] \
            == "processed_logprobs"
        assert config.algorithm.rollout_correction.bypass_mode is False
        snapshot = OmegaConf.to_container(config)
        adapter.configure_verl(config)  # configuring twice changes nothing
        assert OmegaConf.to_container(config) == snapshot
    finally:
        adapter.set_active_config(None)


# Every key of the rollout_parity block at a value other than its default, as a Hydra override, and the
# flags it must give (TRL's and the launcher's tables: test_trl_adapter.py, tests/test_shared_helpers.py).
VERL_EVERY_FLAG = [
    (["+rollout_parity.rollout_importance_sampling_mode=token_mask"], dict(rollout_importance_sampling_mode="token_mask")),
    (["+rollout_parity.rollout_importance_sampling_threshold=3.5"], dict(rollout_importance_sampling_threshold=3.5)),
    (["+rollout_parity.rollout_importance_sampling_threshold_lower=0.5"],
     dict(rollout_importance_sampling_threshold_lower=0.5)),
    (["+rollout_parity.rollout_importance_sampling_sequence_reduction=product"],
     dict(rollout_importance_sampling_sequence_reduction="product")),
    (["+rollout_parity.rollout_importance_sampling_sequence_mask_weight=sequence"],
     dict(rollout_importance_sampling_sequence_mask_weight="sequence")),
    (["+rollout_parity.rollout_rejection=[seq_max_k2,seq_mean_k1]", "+rollout_parity.rollout_rejection_threshold=[0.02,'0.5_2']"],
     dict(rollout_rejection=["seq_max_k2", "seq_mean_k1"], rollout_rejection_threshold=[0.02, "0.5_2"])),
    (["+rollout_parity.off_policy_sequence_mask_delta=0.25"], dict(off_policy_sequence_mask_delta=0.25)),
    (["+rollout_parity.old_logprob_source=bypass"], dict(old_logprob_source="bypass")),
    (["+rollout_parity.log_rollout_offpolicy_metrics=true"], dict(log_rollout_offpolicy_metrics=True)),
    (["+rollout_parity.fp32_lm_head=true"], dict(fp32_lm_head=True)),
    (["+rollout_parity.weight_sync_check_interval=3"], dict(weight_sync_check_interval=3)),
    (["+rollout_parity.weight_sync_check_threshold=0.2"], dict(weight_sync_check_threshold=0.2)),
    (["+rollout_parity.moe_routing_replay=true"], dict(moe_routing_replay=True)),
    (["+rollout_parity.rollout_sampling_replay=true"], dict(rollout_sampling_replay=True)),
    (["+rollout_parity.compile_correction=true"], dict(compile_correction=True)),
    (["+rollout_parity.precision=float16"], dict(precision="fp16")),
    (["+rollout_parity.preset=icepop"], CorrectionConfig.preset("icepop").to_dict()),
]


@pytest.mark.parametrize("overrides,flags", VERL_EVERY_FLAG, ids=lambda x: x[0] if isinstance(x, list) else "")
def test_every_key_of_the_block_reaches_the_flags(overrides, flags):
    assert adapter.correction_config_from_verl(compose_verl(*overrides)) == CorrectionConfig(**flags) \
        != CorrectionConfig()
    assert {k for _, f in VERL_EVERY_FLAG[:-1] for k in f} == set(CorrectionConfig.field_names())


@pytest.mark.parametrize("rejection, verl_bypass", [(False, True), (True, False)])
def test_bypass_uses_verls_switch_unless_rejection_needs_pi_old_before_the_advantages(rejection, verl_bypass):
    extra = ["+rollout_parity.rollout_rejection=[token_k3]", "+rollout_parity.rollout_rejection_threshold=0.5"] \
        if rejection else []
    config = compose_verl("+rollout_parity.old_logprob_source=bypass", *extra)
    try:
        assert adapter.configure_verl(config).old_logprob_source == "bypass"
        rc = config.algorithm.rollout_correction
        assert rc.bypass_mode is verl_bypass and rc.rollout_is is None and rc.rollout_rs is None
        assert "hf_overrides" not in config.actor_rollout_ref.rollout.engine_kwargs.vllm
    finally:
        adapter.set_active_config(None)


def test_preset_and_an_existing_external_lib():
    config = compose_verl("+rollout_parity.preset=verl_decoupled_token_is", "actor_rollout_ref.model.external_lib=my_models")
    try:
        assert adapter.configure_verl(config) == CorrectionConfig.preset("verl_decoupled_token_is")
        assert list(config.actor_rollout_ref.model.external_lib) == ["my_models", "rollout_parity.adapters.verl"]
    finally:
        adapter.set_active_config(None)


def test_top_p_turns_on_the_sampler_aware_pass_for_every_ray_actor():
    config = compose_verl("+rollout_parity.rollout_importance_sampling_mode=token_truncate",
                          "actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_k=20")
    if not has_v1_trainer():
        # verl 0.8: main_ppo drops the actor's extra log-prob outputs, main_ppo_sync's driver step is out of reach
        with pytest.raises(ValueError, match=r"sampler-aware pi_old .*needs verl's V1 trainer \(verl >= 0\.9\)"):
            adapter.configure_verl(config)
        assert adapter.active_config() is None
        return
    try:
        adapter.configure_verl(config)
        env = config.ray_kwargs.ray_init.runtime_env.env_vars
        assert json.loads(env[adapter.ENV_SAMPLER]) == {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "min_p": 0.0}
        assert adapter.active_sampler() == SamplerSettings(top_k=20, top_p=0.9)
    finally:
        adapter.set_active_config(None)
    assert adapter.active_sampler() is None


def test_the_ray_job_imports_the_adapter_after_the_users_own_modules(monkeypatch):
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "my_platform,my_models")
    config = compose_verl("+rollout_parity.rollout_importance_sampling_mode=token_truncate")
    try:
        adapter.configure_verl(config)
        env = config.ray_kwargs.ray_init.runtime_env.env_vars
        assert env["VERL_USE_EXTERNAL_MODULES"] == f"my_platform,my_models,{adapter.MODULE}"
    finally:
        adapter.set_active_config(None)


def test_bypass_with_rejection_needs_the_v1_trainer_under_a_transferqueue_trainer():
    """verl 0.8's main_ppo_sync (transfer_queue.enable=true): old_log_probs := rollout_log_probs cannot reach
    the loss; verl 0.9's V1 trainer (and any legacy trainer: the batch itself travels on) takes it."""
    config = compose_verl("+rollout_parity.old_logprob_source=bypass", "+rollout_parity.rollout_rejection=[seq_sum_k3]",
                          "+rollout_parity.rollout_rejection_threshold=0.001", "transfer_queue.enable=true")
    try:
        if has_v1_trainer():
            assert adapter.configure_verl(config).old_logprob_source == "bypass"
            assert config.algorithm.rollout_correction.bypass_mode is False  # pi_old's pass stays
        else:
            with pytest.raises(ValueError, match=r"bypass with rollout_rejection.*main_ppo_sync"):
                adapter.configure_verl(config)
        legacy = compose_verl("+rollout_parity.old_logprob_source=bypass", "+rollout_parity.rollout_rejection=[seq_sum_k3]",
                              "+rollout_parity.rollout_rejection_threshold=0.001")
        assert adapter.configure_verl(legacy).rollout_rejection == ("seq_sum_k3",)
    finally:
        adapter.set_active_config(None)


@pytest.mark.slow
def test_the_flags_reach_every_ray_process_and_configuring_after_ray_started_without_them_is_refused(tmp_path):
    """verl's own run_ppo on a local Ray: the TaskRunner and an actor it starts (as RayWorkerGroup does) see the
    flags and have the adapter applied, though the launcher has no VERL_USE_EXTERNAL_MODULES; verl 0.8's
    re-validation inside the TaskRunner passes; different flags after ray.init are refused (support module)."""
    import shutil
    import tempfile

    from integration_tests.support.verl_main_ppo import end_session

    ray_tmp = tempfile.mkdtemp(prefix="rp-ray-")  # Ray's sockets must fit an AF_UNIX path (107 bytes)
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.Popen([sys.executable, "-m", "integration_tests.support.verl_ray_flags", str(tmp_path / "probe.json")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        end_session(proc.pid)  # whatever Ray left in the run's own session
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in out.splitlines() if line.startswith("RESULT_JSON ")]
    assert proc.returncode == 0 and lines, out[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT_JSON "))
    expected = CorrectionConfig.preset("tis_srs_k3").to_dict()
    assert result["driver_env_modules"] is None
    assert adapter.MODULE in result["job_env"]["VERL_USE_EXTERNAL_MODULES"].split(",")
    pids = {result[who]["pid"] for who in ("driver", "runner", "worker")}
    assert len(pids) == 3  # three processes
    for who in ("driver", "runner", "worker"):
        state = result[who]
        assert state["adapter_loaded"] and state["applied"], who
        assert CorrectionConfig.from_dict(state["flags"]).to_dict() == expected, who
    assert result["worker"]["rank_env"] == "0"  # the worker's own env_vars merged with the job's
    assert CorrectionConfig.from_dict(result["runner_revalidated"]).to_dict() == expected
    assert result["driver_reconfigured"]
    for who in ("runner_other_flags", "driver_other_flags"):
        assert "Ray is already initialized" in result[who] and adapter.ENV_CONFIG in result[who], who


VALID_RUN = ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
             "algorithm.adv_estimator=grpo", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "trainer.n_gpus_per_node=1"]


def test_verls_patched_validate_config_configures_then_validates():
    """What main_ppo.main calls at start: ours first, then verl's own checks pass on the rewrite."""
    import verl.utils.config as verl_config
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    assert hasattr(verl_config.validate_config, MARK)
    config = compose_verl("+rollout_parity.preset=tis_srs_k3", "+rollout_parity.fp32_lm_head=true", *VALID_RUN)
    try:
        verl_config.validate_config(config, use_reference_policy=need_reference_policy(config),
                                    use_critic=need_critic(config))
        assert adapter.active_config() == CorrectionConfig.preset("tis_srs_k3", fp32_lm_head=True)
    finally:
        adapter.set_active_config(None)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"


def _real_command_line(tmp_path, module, *overrides, full_error=True):
    # VERL_USE_EXTERNAL_MODULES: what the docs tell verl 0.8 users (no verl.plugins entry points there)
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES=adapter.MODULE, HYDRA_FULL_ERROR="1")
    if not full_error:  # what a user sees: Hydra's own error report
        env.pop("HYDRA_FULL_ERROR")
    return subprocess.run([sys.executable, "-m", module, *BASE_OVERRIDES, *VALID_RUN, *overrides,
                           f"hydra.run.dir={tmp_path}"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_a_real_main_ppo_command_line_rejects_a_bad_flag_at_start(tmp_path):
    """``python -m verl.trainer.main_ppo ... +rollout_parity.<bad>`` fails before Ray starts (verl 0.8's
    main_ppo validates only inside its Ray TaskRunner: our check runs in ``auto_set_device``)."""
    proc = _real_command_line(tmp_path, "verl.trainer.main_ppo", "+rollout_parity.rollout_importance_sampling_mode=token_clip")
    assert proc.returncode != 0
    assert "rollout_importance_sampling_mode: unknown mode 'token_clip'" in proc.stderr
    assert "ray init kwargs" not in proc.stdout  # stopped before run_ppo


def test_a_typo_on_a_real_main_ppo_command_line_is_one_line_naming_the_flag(tmp_path):
    """Hydra's report of our refusal is its message alone (a CompactHydraException): no traceback, at most
    3 lines with Hydra's own framing, the closest flag named."""
    proc = _real_command_line(tmp_path, "verl.trainer.main_ppo",
                              "+rollout_parity.rollout_importance_sampling_mod=token_truncate", full_error=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    report = [line for line in proc.stderr[proc.stderr.index("Error executing job"):].splitlines() if line.strip()]
    assert len(report) <= 3, report
    assert ("rollout-parity: unknown flag rollout_parity.rollout_importance_sampling_mod "
            "(did you mean 'rollout_parity.rollout_importance_sampling_mode'?)") in report


def test_a_real_main_ppo_command_line_hands_the_flags_to_ray_init(tmp_path):
    """The validated flags are in the runtime_env verl's run_ppo passes to ``ray.init`` (stopped right there by
    a keyword ray.init does not know)."""
    proc = _real_command_line(tmp_path, "verl.trainer.main_ppo", "+rollout_parity.preset=tis_srs_k3",
                              "+ray_kwargs.ray_init.rollout_parity_test_stop=1")
    assert "Unknown keyword argument(s): rollout_parity_test_stop" in proc.stderr, proc.stderr[-3000:]
    configured = proc.stdout.index("[rollout-parity] verl configured")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("ray init kwargs: "))
    assert configured < proc.stdout.index(line)
    ray_init = ast.literal_eval(line.removeprefix("ray init kwargs: "))
    env_vars = ray_init["runtime_env"]["env_vars"]
    assert CorrectionConfig.from_dict(json.loads(env_vars[adapter.ENV_CONFIG])) == CorrectionConfig.preset("tis_srs_k3")
    assert adapter.MODULE in env_vars["VERL_USE_EXTERNAL_MODULES"].split(",")


@pytest.mark.skipif(importlib.util.find_spec("verl.trainer.main_ppo_sync") is None,
                    reason="verl >= 0.9 has no main_ppo_sync (its V1 trainer replaced it)")
def test_verl_08s_main_ppo_sync_refuses_bypass_with_rejection_at_start(tmp_path):
    proc = _real_command_line(tmp_path, "verl.trainer.main_ppo_sync", "+rollout_parity.old_logprob_source=bypass",
                              "+rollout_parity.rollout_rejection=[seq_sum_k3]",
                              "+rollout_parity.rollout_rejection_threshold=0.001")
    assert proc.returncode != 0
    assert "bypass with rollout_rejection" in proc.stderr and "main_ppo_sync" in proc.stderr, proc.stderr[-3000:]
    assert "ray init kwargs" not in proc.stdout


@pytest.mark.parametrize("overrides, flag", [
    (["+rollout_parity.rollout_importance_sampling_mode=token_clip"], "rollout_importance_sampling_mode"),
    (["+rollout_parity.rollout_importance_sampling_threshold=-1"], "rollout_importance_sampling_threshold"),
    (["+rollout_parity.rollout_rejection=[seq_sum_k4]"], "rollout_rejection"),
    (["+rollout_parity.rollout_importance_sampling_treshold=2"], "rollout_importance_sampling_treshold"),
    (["+actor_rollout_ref.rollout.engine_kwargs.vllm.enable_prefix_caching=true"], "enable_prefix_caching"),
    (["+rollout_parity.fp32_lm_head=true", "actor_rollout_ref.model.use_fused_kernels=true"], "use_fused_kernels"),
    (["+rollout_parity.fp32_lm_head=true", "actor_rollout_ref.actor.strategy=megatron"], "strategy"),
    (["actor_rollout_ref.rollout.top_k=20", "++trainer.use_v1=false"], "use_v1"),
    # an engine with no recipe of ours (SGLang's: test_verl_sglang.py)
    (["actor_rollout_ref.rollout.name=trtllm"], r"rollout\.name='trtllm': .* writes the parity recipe of vllm, "
                                               "sglang only"),
    (["actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"], r"rollout\.logprobs_mode='raw_logprobs' contradicts"),
])
def test_what_cannot_be_expressed_fails_at_start_naming_it(overrides, flag):
    if not any(o.startswith("+rollout_parity.") for o in overrides):
        overrides = ["+rollout_parity.rollout_importance_sampling_mode=token_truncate", *overrides]
    config = compose_verl(*overrides)
    before = OmegaConf.to_container(config)
    with pytest.raises(ValueError, match=flag):
        adapter.configure_verl(config)
    assert adapter.active_config() is None
    assert OmegaConf.to_container(config) == before  # refused before anything was written


def test_verls_default_prefix_caching_is_overridden_and_said_so(capsys):
    """verl's own default (rollout.enable_prefix_caching=True) is not the recipe's: turned off, printed (not
    only at INFO, which verl's logging setup hides); set on the command line it is refused (next test)."""
    config = compose_verl("+rollout_parity.rollout_importance_sampling_mode=token_truncate")
    assert config.actor_rollout_ref.rollout.enable_prefix_caching is True
    try:
        adapter.configure_verl(config)
    finally:
        adapter.set_active_config(None)
    assert config.actor_rollout_ref.rollout.enable_prefix_caching is False
    out = capsys.readouterr().out
    assert "[rollout-parity] verl settings overridden: " in out
    assert "actor_rollout_ref.rollout.enable_prefix_caching: True -> False" in out


def test_a_real_main_ppo_command_line_refuses_prefix_caching_set_on_it(tmp_path):
    """``actor_rollout_ref.rollout.enable_prefix_caching=true`` on the command line is the user's choice, the
    same setting as ``engine_kwargs.vllm.enable_prefix_caching=true``: refused alike, before Ray starts."""
    proc = _real_command_line(tmp_path, "verl.trainer.main_ppo", "+rollout_parity.preset=tis_srs_k3",
                              "actor_rollout_ref.rollout.enable_prefix_caching=true")
    assert proc.returncode != 0
    assert "actor_rollout_ref.rollout.enable_prefix_caching=True contradicts the parity recipe" in proc.stderr, \
        proc.stderr[-3000:]
    assert "ray init kwargs" not in proc.stdout


def _job(monkeypatch, env_vars):
    """This process as the driver of a ``ray job submit`` whose runtime env has ``env_vars``."""
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"env_vars": env_vars}}))
    for key, value in env_vars.items():  # Ray sets the job's variables in the driver's environment too
        monkeypatch.setenv(key, value)


def test_a_submitted_job_carrying_verl_use_external_modules_keeps_it(monkeypatch):
    """``ray job submit --runtime-env-json '{"env_vars": {"VERL_USE_EXTERNAL_MODULES": ...}}'`` (verl 0.8's only
    way to load the adapter in a submitted driver): the adapter leaves the key to the job, as verl does with its
    own defaults, and Ray's own merge of the job's env with verl's ``ray.init`` env succeeds (it refused the
    duplicate key before: "Failed to merge the Job's runtime env")."""
    from ray.runtime_env.runtime_env import _merge_runtime_env
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    job_env = {"VERL_USE_EXTERNAL_MODULES": f"my_platform,{adapter.MODULE}", "MY_SETTING": "1"}
    _job(monkeypatch, job_env)
    config = compose_verl("+rollout_parity.preset=tis_srs_k3")
    try:
        adapter.configure_verl(config)
    finally:
        adapter.set_active_config(None)
    env_vars = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert "VERL_USE_EXTERNAL_MODULES" not in env_vars
    assert CorrectionConfig.from_dict(json.loads(env_vars[adapter.ENV_CONFIG])) == CorrectionConfig.preset("tis_srs_k3")
    # what verl's run_ppo hands ray.init, then what ray.init does with it inside a submitted job
    verls_env = get_ppo_ray_runtime_env(*[config][:len(inspect.signature(get_ppo_ray_runtime_env).parameters)])
    driver_env = OmegaConf.to_container(OmegaConf.merge(verls_env,  # verl 0.8's takes no config
                                                        config.ray_kwargs.ray_init.runtime_env))
    merged = _merge_runtime_env({"env_vars": job_env}, driver_env)
    assert merged is not None, "Ray would refuse the job"
    assert merged["env_vars"]["VERL_USE_EXTERNAL_MODULES"] == job_env["VERL_USE_EXTERNAL_MODULES"]
    assert merged["env_vars"][adapter.ENV_CONFIG] == env_vars[adapter.ENV_CONFIG]


def test_a_submitted_job_whose_modules_lack_the_adapter_is_refused_naming_the_fix(monkeypatch):
    _job(monkeypatch, {"VERL_USE_EXTERNAL_MODULES": "my_platform"})
    config = compose_verl("+rollout_parity.preset=tis_srs_k3")
    with pytest.raises(ValueError, match=r"VERL_USE_EXTERNAL_MODULES='my_platform' without rollout_parity\.adapters"
                                         r"\.verl.*--runtime-env-json .*my_platform,rollout_parity\.adapters\.verl"):
        adapter.configure_verl(config)
    assert adapter.active_config() is None
    _job(monkeypatch, {adapter.ENV_CONFIG: "{}"})
    with pytest.raises(ValueError, match=f"sets {adapter.ENV_CONFIG}"):
        adapter.configure_verl(compose_verl("+rollout_parity.preset=tis_srs_k3"))


@pytest.mark.parametrize("loss_mode", ["gspo", "cispo", "geo_mean"])
def test_any_verl_loss_mode_is_kept(loss_mode):
    config = compose_verl("+rollout_parity.rollout_importance_sampling_mode=token_truncate",
                          f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}")
    try:
        adapter.configure_verl(config)
    finally:
        adapter.set_active_config(None)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == loss_mode


def test_no_block_leaves_verls_config_untouched():
    config = compose_verl()
    before = OmegaConf.to_container(config)
    assert adapter.configure_verl(config) is None
    assert OmegaConf.to_container(config) == before


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


def test_double_correction_is_refused_on_the_driver_too(flags):
    flags(CorrectionConfig.preset("verl_decoupled_token_is"))
    batch = make_shared_batch()
    with pytest.raises(ValueError, match="double correction"):
        driver(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask, {"rollout_is": "token", "rollout_rs": None})


# ============================================================================= the shared batch

DECOUPLED_EXACT = [n for n in all_config_names() if config_for(n).off_policy_sequence_mask_delta is None]
# C(r_ppo^rollout) needs rollout logprobs inside the loss, which verl does not pass in decoupled mode.
NOT_IN_VERL_DECOUPLED = {"rollout_correction/loss_contrib_rollout_pos", "rollout_correction/loss_contrib_rollout_neg"}


@pytest.mark.parametrize("name", DECOUPLED_EXACT)
def test_shared_batch_decoupled_matches_the_core(name, actor_config, flags):
    """Driver hook -> verl's own vanilla loss on our weights and mask == the core, to 1e-6."""
    cfg = flags(config_for(name))
    batch = make_shared_batch()
    ref = core_reference(name)
    proto, weights, driver_metrics = driver(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    mask = proto.batch["response_mask"]
    torch.testing.assert_close(mask, ref["mask"], atol=0, rtol=0)
    if cfg.rollout_importance_sampling_mode is not None:
        torch.testing.assert_close(weights, ref["weights"], atol=ATOL, rtol=ATOL)
    else:
        assert weights is None  # nothing to weight: verl's loss gets no rollout_is_weights
    current = batch.fresh_current()
    loss, loss_metrics = verl_loss(actor_config, old=batch.old_logprobs, cur=current, adv=token_advantages(batch),
                                   mask=mask, weights=weights)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref["loss"], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(current.grad, ref["grad"], atol=ATOL, rtol=ATOL)
    assert loss.item() == pytest.approx(load_expected()[name]["loss"], abs=ATOL)
    metrics = {**driver_metrics, **{k: v for k, v in loss_metrics.items()
                                    if not k.startswith("actor/") or k in LOSS_METRICS.values()}}
    expected = {LOSS_METRICS.get(k, k): v for k, v in ref["metrics"].items() if k not in NOT_IN_VERL_DECOUPLED}
    expected = verl_names(expected, cfg)  # verl's rollout_corr/* names where verl has the formula
    expected["rollout_correction/loss_nonfinite_frac"] = 0.0  # the loss's own inputs (pi_old, pi_theta) are finite
    if not cfg.wants_metrics:
        expected = {k: v for k, v in expected.items() if not k.startswith(("rollout_correction/", "rollout_corr/"))}
        expected["rollout_correction/loss_nonfinite_frac"] = 0.0
    else:
        # C(r_ppo^train) = -(pi_theta/pi_old - 1) A (paper eq. 5) over the tokens the loss sees: naive reference.
        seen = ref["mask"].bool()
        contrib = -(torch.exp(batch.current_logprobs.detach() - batch.old_logprobs) - 1) * batch.advantages[:, None]
        n = seen.sum().item()
        expected["rollout_correction/loss_contrib_pos"] = (contrib * (seen & (batch.advantages[:, None] > 0))).sum().item() / n
        expected["rollout_correction/loss_contrib_neg"] = (contrib * (seen & (batch.advantages[:, None] < 0))).sum().item() / n
    # beyond the core's set: the rest of what verl's own correction logs (verl_keys.verl_metrics), each checked
    # against verl's code in test_verl_own_metrics.py
    beyond = {k for k in set(metrics) - set(expected) if k == "rollout_corr/kl" or k.startswith((
        "rollout_corr/rollout_is_", "rollout_corr/rollout_rs_", "rollout_correction/is_", "rollout_correction/rejection/"))}
    assert set(metrics) - beyond == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=ATOL, rel=ATOL), key
    # verl's own vanilla ppo_kl is the core's ppo_k1_mean; we log no copy of it
    assert not [k for k in loss_metrics if k.endswith("ppo_k1_mean") or k.startswith("policy/")]


def test_shared_batch_off_policy_mask_in_decoupled_verl_uses_pi_old_as_behaviour(actor_config, flags):
    """The loss cannot see rollout logprobs in decoupled verl: the behaviour policy is pi_old
    (docs/verl_pi_old.md, "Where π_old comes from")."""
    cfg = flags(config_for("off_policy_mask"))
    batch = make_shared_batch()
    proto, weights, _ = driver(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    no_delta = compute_correction(cfg.replace(off_policy_sequence_mask_delta=None), old_logprobs=batch.old_logprobs,
                                  rollout_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask)
    torch.testing.assert_close(weights, no_delta.weights, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(proto.batch["response_mask"], no_delta.mask, atol=0, rtol=0)
    current = batch.fresh_current()
    loss, metrics = verl_loss(actor_config, old=batch.old_logprobs, cur=current, adv=token_advantages(batch),
                              mask=proto.batch["response_mask"], weights=weights)
    loss.backward()
    # naive reference: delta_i = mean_t(old - current) over valid tokens, masked when > delta and A_i < 0
    valid = batch.response_mask.bool()
    drift = ((batch.old_logprobs - batch.current_logprobs.detach()) * valid).sum(-1) / valid.sum(-1).clamp_min(1)
    off = (drift > cfg.off_policy_sequence_mask_delta) & (batch.advantages < 0) & valid.any(-1)
    assert off.any()
    no_delta.mask = (no_delta.mask.bool() & ~off.unsqueeze(-1)).float()
    reference = batch.fresh_current()
    ref_loss, _ = policy_loss(cfg, current_logprobs=reference, old_logprobs=batch.old_logprobs,
                              advantages=batch.advantages, correction=no_delta, clip_ratio=0.2, clip_ratio_c=3.0)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(current.grad, reference.grad, atol=ATOL, rtol=ATOL)
    assert metrics["rollout_correction/off_policy_masked_frac"] == pytest.approx(
        off.sum().item() / valid.any(-1).sum().item(), abs=ATOL)


BYPASS_CONFIGS = {
    # verl's own bypass switch (no pi_old pass): everything happens in the loss wrapper
    "bypass_off_policy": dict(old_logprob_source="bypass", off_policy_sequence_mask_delta=0.02,
                              log_rollout_offpolicy_metrics=True),
    # bypass with rejection: the driver rejects with pi_theta at the start of the update, then
    # hands the loss old_log_probs := rollout_log_probs
    "bypass_rejection": dict(old_logprob_source="bypass", rollout_rejection=["seq_sum_k3"],
                             rollout_rejection_threshold=0.05),
}


@pytest.mark.parametrize("name", sorted(BYPASS_CONFIGS))
def test_shared_batch_bypass_matches_the_core(name, actor_config, flags):
    cfg = flags(CorrectionConfig(**BYPASS_CONFIGS[name]))
    batch = make_shared_batch()
    # the core, as a user of the core would call it (pi_old is pi_rollout; NaN pi_old is neutral)
    current_ref = batch.fresh_current()
    out = compute_correction(cfg, rollout_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask,
                             advantages=batch.advantages, current_logprobs=current_ref)
    ref_loss, ref_metrics = policy_loss(cfg, current_logprobs=current_ref, advantages=batch.advantages,
                                        correction=out, clip_ratio=0.2, clip_ratio_c=3.0)
    ref_loss.backward()
    if cfg.rollout_rejection is None:  # verl copied rollout_log_probs into old_log_probs; no driver hook
        old, mask, driver_metrics = batch.rollout_logprobs, batch.response_mask, {}
    else:  # verl's pi_old pass at the start of the update gives pi_theta's logprobs
        proto, _, driver_metrics = driver(batch.current_logprobs.detach(), batch.rollout_logprobs, batch.response_mask)
        old, mask = proto.batch["old_log_probs"], proto.batch["response_mask"]
        assert torch.equal(old.nan_to_num(7.0), batch.rollout_logprobs.nan_to_num(7.0))  # the PPO anchor is pi_rollout
        torch.testing.assert_close(mask, out.mask, atol=0, rtol=0)
        assert out.mask.sum() < batch.response_mask.sum()  # the config really rejected something
    current = batch.fresh_current()
    loss, loss_metrics = verl_loss(actor_config, old=old, cur=current, adv=token_advantages(batch), mask=mask,
                                   weights=None)
    loss.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(current.grad, current_ref.grad, atol=ATOL, rtol=ATOL)
    metrics = {**driver_metrics, **loss_metrics}
    for key, logged in LOSS_METRICS.items():
        assert metrics[logged] == pytest.approx(ref_metrics[key], abs=ATOL), key
    if cfg.rollout_rejection is not None:
        # C(r_ppo) = -(pi_theta/pi_rollout - 1) A is logged by the loss over the tokens it sees (after
        # rejection), finite ones summed, all counted: naive reference instead of the core's pre-rejection one
        seen = out.mask.bool()
        finite = torch.isfinite(batch.rollout_logprobs)
        contrib = -(torch.exp(batch.current_logprobs.detach() - batch.rollout_logprobs) - 1) * batch.advantages[:, None]
        contrib = torch.where(seen & finite, contrib, torch.zeros(()))
        for sign, key in ((1, "pos"), (-1, "neg")):
            value = (contrib * (sign * batch.advantages[:, None] > 0)).sum().item() / seen.sum().item()
            ref_metrics[f"rollout_correction/loss_contrib_{key}"] = value
    ref_metrics = verl_names(ref_metrics, cfg)  # verl's rollout_corr/* names where verl has the formula
    shared = [k for k in ref_metrics if k.startswith(("rollout_correction/", "rollout_corr/")) and k in metrics]
    assert {"rollout_correction/k1_mean", "rollout_corr/k3_kl", "rollout_correction/loss_contrib_pos"} <= set(shared)
    for key in shared:
        assert metrics[key] == pytest.approx(ref_metrics[key], abs=ATOL, rel=ATOL), key
    # the engine's NaN / -inf reached the PPO ratio as pi_old: neutral, and counted among the loss's tokens
    given = mask.bool()
    bad = (given & ~torch.isfinite(batch.rollout_logprobs)).sum().item()
    assert bad > 0 and metrics["rollout_correction/loss_nonfinite_frac"] == pytest.approx(bad / given.sum().item(),
                                                                                            abs=ATOL)


# ============================================================================= fp32 lm_head hook

def test_fp32_lm_head_is_applied_when_the_actor_model_is_built(flags):
    """FSDPEngine._build_module (load, before LoRA/QAT/FSDP) is wrapped; the head then returns fp32."""
    import transformers
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from rollout_parity.core.fp32_head import is_fp32_lm_head
    from rollout_parity.testing.tiny_model import build_tiny_model

    wrapper = FSDPEngine.__dict__["_build_module"]
    assert hasattr(wrapper, MARK) and wrapper.__wrapped__.__qualname__ == "FSDPEngine._build_module"
    path = build_tiny_model()

    class FakeEngine:  # what the wrapper reads of verl's engine
        model_config = type("ModelConfig", (), {"model_type": "language_model"})()

    def build(fp32):
        flags(CorrectionConfig(fp32_lm_head=fp32))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        return actor.fp32_head_after_build(lambda self: model, FakeEngine())

    try:
        with_head, without = build(True), build(False)
    finally:
        adapter.set_active_config(None)
    hidden = torch.randn(2, 3, with_head.config.hidden_size, dtype=torch.bfloat16)
    assert is_fp32_lm_head(with_head) and with_head.get_output_embeddings()(hidden).dtype == torch.float32
    assert not is_fp32_lm_head(without) and without.get_output_embeddings()(hidden).dtype == torch.bfloat16


# ============================================================================= verl and TRL side by side

def test_verls_trl_detection_is_off_only_while_trl_lacks_the_value_head_class():
    trl = need("trl", extra="trl")
    import verl.models.transformers.monkey_patch as monkey_patch
    from verl.utils.import_utils import is_trl_available

    if hasattr(trl, "AutoModelForCausalLMWithValueHead"):
        pytest.skip(f"TRL {trl.__version__} still has the value-head class: verl's detection stays on")
    assert is_trl_available()  # TRL is installed ...
    assert monkey_patch.is_trl_available() is False  # ... but verl's value-head patch is told it is not
    adapter.revert()
    try:
        assert monkey_patch.is_trl_available() is True  # verl's own answer: its patch would import the class
        with pytest.raises(ImportError, match="AutoModelForCausalLMWithValueHead"):
            from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
    finally:
        adapter.apply()


# ============================================================================= baselines (verl#6362)

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


def test_rejected_sequences_leave_verls_grpo_baselines(flags):
    """Driver hook, then verl's own compute_advantage (GRPO): rejected siblings do not move the baseline."""
    import numpy as np
    from verl.trainer.ppo.ray_trainer import compute_advantage

    cfg = flags(CorrectionConfig(rollout_rejection=["seq_sum_k3"], rollout_rejection_threshold=0.05))
    old, rollout, mask, rewards, uid = grpo_batch()

    def proto():
        return DataProto.from_dict(tensors={"old_log_probs": old.clone(), "rollout_log_probs": rollout.clone(),
                                            "response_mask": mask.clone(), "token_level_rewards": rewards.clone()},
                                   non_tensors={"uid": np.array(uid, dtype=object)})

    ours, _ = helper.compute_rollout_correction_and_add_to_batch(proto(), {"rollout_is": None, "rollout_rs": None})
    kept_rows = ours.batch["response_mask"].bool().any(-1)
    assert kept_rows.tolist() == [True, False, True, True, True, True, False, True]
    ours = compute_advantage(ours, adv_estimator="grpo", num_repeat=4)
    expected = naive_grpo(rewards.sum(-1), ours.batch["response_mask"], uid, kept_rows)
    torch.testing.assert_close(ours.batch["advantages"], expected, atol=1e-5, rtol=1e-5)

    # the leak the hook closes: verl's own path keeps the rejected rewards in the group statistics
    original = helper.compute_rollout_correction_and_add_to_batch.__wrapped__
    theirs, _ = original(proto(), verl_equivalent(cfg))
    theirs = compute_advantage(theirs, adv_estimator="grpo", num_repeat=4)
    torch.testing.assert_close(theirs.batch["response_mask"], ours.batch["response_mask"])
    assert not torch.allclose(theirs.batch["advantages"], expected, atol=1e-3)


def test_a_rejected_reward_token_keeps_the_rows_score(flags):
    """Token-level rejection of a row's final (reward) token: the row keeps its other tokens, and its outcome
    reward with them (moved to its last kept token); its siblings' baselines see its real score.

    Reference: GRPO written out over every row's real score (no row is fully rejected here). Before the fix
    the hook masked the reward with the token, so a correct answer trained on with score 0."""
    import numpy as np
    from verl.trainer.ppo.ray_trainer import compute_advantage

    flags(CorrectionConfig(rollout_rejection=["token_k2"], rollout_rejection_threshold=0.02))
    old, rollout, mask, rewards, uid = grpo_batch(1)
    rewards[0, 0] = 0.25  # and a process reward on a kept token stays where it is
    rollout = old.clone()
    last = mask.sum(-1).long() - 1
    rollout[0, last[0]] += 1.0  # only row 0's reward token is off
    proto = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                         "token_level_rewards": rewards.clone()},
                                non_tensors={"uid": np.array(uid, dtype=object)})
    out, _ = helper.compute_rollout_correction_and_add_to_batch(proto, {"rollout_is": None, "rollout_rs": None})
    new_mask = out.batch["response_mask"]
    assert new_mask[0, last[0]] == 0 and new_mask.sum() == mask.sum() - 1
    moved = out.batch["token_level_rewards"]
    assert moved[0, last[0] - 1] == rewards[0, last[0]] and moved[0, last[0]] == 0 and moved[0, 0] == 0.25
    torch.testing.assert_close(moved[1:], rewards[1:])  # the other rows are untouched
    torch.testing.assert_close(moved.sum(-1), rewards.sum(-1))
    grpo = compute_advantage(out, adv_estimator="grpo", num_repeat=4)
    expected = naive_grpo(rewards.sum(-1), new_mask, uid, torch.ones(len(uid), dtype=torch.bool))
    torch.testing.assert_close(grpo.batch["advantages"], expected, atol=1e-5, rtol=1e-5)
    lost = rewards.sum(-1)
    lost[0] = 0.25  # what masking the reward with its token made of row 0's score
    leaky = naive_grpo(lost, new_mask, uid, torch.ones(len(uid), dtype=torch.bool))
    assert (leaky[:4] - expected[:4]).abs().max() > 0.1  # the whole group's advantages would move


def test_gae_keeps_the_reward_of_a_rejected_last_token(flags):
    """verl's GAE skips masked positions (their reward is dropped): the moved reward reaches the returns."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    flags(CorrectionConfig(rollout_rejection=["token_k2"], rollout_rejection_threshold=0.02))
    old, _, mask, rewards, _ = grpo_batch(1)
    rollout = old.clone()
    last = mask.sum(-1).long() - 1
    rollout[torch.arange(len(last)), last] += 1.0  # every row's reward token is off
    proto = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                         "token_level_rewards": rewards.clone()})
    out, _ = helper.compute_rollout_correction_and_add_to_batch(proto, {"rollout_is": None, "rollout_rs": None})
    values = torch.zeros_like(mask)
    _, returns = compute_gae_advantage_return(out.batch["token_level_rewards"], values, out.batch["response_mask"],
                                              gamma=torch.tensor(1.0), lam=torch.tensor(1.0))
    # gamma = lam = 1, zero values: every kept token's return is the row's whole reward
    torch.testing.assert_close(returns[:, 0], rewards.sum(-1))


def test_bypass_under_top_p_puts_pi_rollout_on_the_trainers_support(flags):
    """bypass + top_p: old_log_probs := rollout + log S (the trainer's kept mass), not the renormalised rollout.

    The PPO ratio pi_theta / pi_old then compares full-vocabulary logprobs on both sides; a token outside
    the trainer's kept set, or an engine NaN, takes the trainer's own full-vocabulary pi_old (neutral).
    """
    cfg = CorrectionConfig(old_logprob_source="bypass", log_rollout_offpolicy_metrics=True)
    flags(cfg)
    adapter.set_active_config(cfg, SamplerSettings(top_p=0.9))
    old, _, mask, _, _ = grpo_batch(4)
    g = torch.Generator().manual_seed(5)
    log_s = -torch.rand(old.shape, generator=g) * 0.3
    processed = old - log_s
    rollout = processed + torch.randn(old.shape, generator=g) * 1e-3
    processed[0, 0] = float("-inf")  # the engine sampled outside the trainer's nucleus
    rollout[1, 1] = float("nan")  # and once returned NaN
    proto = DataProto.from_dict(tensors={"old_log_probs": old.clone(), "rollout_log_probs": rollout.clone(),
                                         "response_mask": mask.clone(), adapter.PROCESSED_FIELD: processed})
    out, metrics = adapter.driver_correction(proto)
    expected = rollout + log_s  # per token, naively
    expected[0, 0], expected[1, 1] = old[0, 0], old[1, 1]
    written = out.batch["old_log_probs"]
    torch.testing.assert_close(written, expected, atol=1e-6, rtol=0)
    assert (written - old).abs()[mask.bool()].max() < 5e-3  # at parity, the ratio's denominator is the trainer's
    assert (rollout - old).abs()[mask.bool() & rollout.isfinite()].mean() > 0.1  # the raw rollout carries log S
    assert metrics["rollout_correction/sampler_log_kept_mass"] < -0.1


def test_driver_hook_refuses_verls_own_correction_handed_to_it(flags):
    """``driver_correction(batch, rollout_corr_config)``: verl's own correction config, as verl's helper is
    called with it, is checked against ours: an IS or rejection of verl's there is a double correction."""
    flags(CorrectionConfig(rollout_importance_sampling_mode="token_truncate"))
    old, rollout, mask, _, _ = grpo_batch(8)

    def proto():
        return DataProto.from_dict(tensors={"old_log_probs": old.clone(), "rollout_log_probs": rollout.clone(),
                                            "response_mask": mask.clone()})

    with pytest.raises(ValueError, match="double correction"):
        adapter.driver_correction(proto(), {"rollout_is": "token", "rollout_rs": None, "bypass_mode": False})
    with pytest.raises(ValueError, match="bypass_mode=true contradicts"):
        adapter.driver_correction(proto(), {"rollout_is": None, "rollout_rs": None, "bypass_mode": True})
    off, _ = adapter.driver_correction(proto(), {"rollout_is": None, "rollout_rs": None, "bypass_mode": False})
    plain, _ = adapter.driver_correction(proto())
    assert torch.equal(off.batch["rollout_is_weights"], plain.batch["rollout_is_weights"])


def test_sampler_penalties_and_scaled_heads_are_refused_as_in_trl(tmp_path):
    """The framework-independent refusals (adapters/_refusals.py) reach verl's config: a penalty in vLLM's
    processed logprobs, or top_p over a soft-capped head, cannot be reproduced by verl's pi_old."""
    flag = "+rollout_parity.rollout_importance_sampling_mode=token_truncate"
    with pytest.raises(ValueError, match=r"repetition_penalty=1\.1: vLLM's processed logprobs include sampler"):
        adapter.configure_verl(compose_verl(flag, "+actor_rollout_ref.rollout.repetition_penalty=1.1"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "final_logit_softcapping": 30.0}))
    capped = ["actor_rollout_ref.rollout.top_p=0.9", f"actor_rollout_ref.model.path={tmp_path}"]
    if has_v1_trainer():
        with pytest.raises(ValueError, match=r"final_logit_softcapping=30\.0: the sampler-aware r_corr"):
            adapter.configure_verl(compose_verl(flag, *capped))
        assert adapter.active_config() is None
    try:  # without a truncating sampler the head is what verl and vLLM both compute: accepted
        adapter.configure_verl(compose_verl(flag, f"actor_rollout_ref.model.path={tmp_path}"))
    finally:
        adapter.set_active_config(None)


def test_sampling_replay_is_refused_in_verl_by_name():
    """verl's vLLM server hands its agent loop token ids and logprobs only: the kept sets cannot reach pi_old."""
    config = compose_verl("+rollout_parity.rollout_importance_sampling_mode=token_truncate",
                          "+rollout_parity.rollout_sampling_replay=true", "actor_rollout_ref.rollout.top_k=50")
    with pytest.raises(ValueError, match="rollout_sampling_replay=true: verl .* never reach the actor"):
        adapter.configure_verl(config)
    assert adapter.active_config() is None


def test_bypass_under_top_p_keeps_verls_pi_old_pass():
    """verl's own bypass_mode skips the pass that measures log S: under a truncating sampler it stays off."""
    config = compose_verl("+rollout_parity.old_logprob_source=bypass", "actor_rollout_ref.rollout.top_p=0.9")
    plain = compose_verl("+rollout_parity.old_logprob_source=bypass")
    try:
        if not has_v1_trainer():
            with pytest.raises(ValueError, match="needs verl's V1 trainer"):
                adapter.configure_verl(config)
            return
        adapter.configure_verl(config)
        assert config.algorithm.rollout_correction.bypass_mode is False
        assert adapter.active_sampler() == SamplerSettings(top_p=0.9)
        adapter.configure_verl(plain)
        assert plain.algorithm.rollout_correction.bypass_mode is True and adapter.active_sampler() is None
    finally:
        adapter.set_active_config(None)


def test_sampler_metrics_name_the_boundary_tokens_and_the_kept_mass(flags):
    """top_p: log S over the tokens both keep; a token outside the trainer's kept set is named, not a NaN."""
    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate")
    flags(cfg)
    adapter.set_active_config(cfg, SamplerSettings(top_p=0.9))
    old, rollout, mask, _, _ = grpo_batch(2)
    log_s = -torch.rand(old.shape, generator=torch.Generator().manual_seed(3)) * 0.3  # log kept mass per position
    processed = old - log_s
    rollout = processed + 1e-3
    processed[0, 0] = float("-inf")  # vLLM sampled a token the trainer's nucleus leaves out
    padded = int((mask.sum(-1) < mask.shape[1]).nonzero()[0])
    processed[padded, -1] = float("-inf")  # ... and one in the padding, which does not count
    proto = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                         adapter.PROCESSED_FIELD: processed})
    _, metrics = adapter.driver_correction(proto)

    valid = mask.bool()
    inside = valid.clone()
    inside[0, 0] = False
    n = valid.sum().item()
    assert metrics["rollout_correction/sampler_outside_kept_frac"] == pytest.approx(1 / n)
    assert metrics["rollout_correction/sampler_log_kept_mass"] == pytest.approx(log_s[inside].mean().item(), abs=1e-6)
    # the core counts it as maximal mismatch; the rest is compared like with like (delta 1e-3, not log S)
    assert metrics["rollout_correction/nonfinite_frac"] == pytest.approx(1 / n)
    assert metrics["rollout_correction/delta_abs_mean"] == pytest.approx((20.0 + 1e-3 * (n - 1)) / n, rel=1e-4)

    # The actor's pass as it runs: the boundary rule gives the missed token a finite processed logprob and
    # the pass says where it applied (OUTSIDE_FIELD): counted, and compared like any other token.
    ruled = old - log_s
    outside = torch.zeros_like(mask)
    outside[0, 0] = 1.0
    proto = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": ruled + 1e-3,
                                         "response_mask": mask, adapter.PROCESSED_FIELD: ruled,
                                         adapter.OUTSIDE_FIELD: outside})
    _, metrics = adapter.driver_correction(proto)
    assert metrics["rollout_correction/sampler_outside_kept_frac"] == pytest.approx(1 / n)
    assert metrics["rollout_correction/nonfinite_frac"] == 0.0
    assert metrics["rollout_correction/delta_abs_mean"] == pytest.approx(1e-3, rel=1e-3)
    assert metrics["rollout_correction/sampler_log_kept_mass"] == pytest.approx(log_s[valid].mean().item(), abs=1e-6)


def _driver_step(case):
    # verl imports the adapter first, as in a run (verl 0.8 has no plugin entry points: the env variable)
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES=adapter.MODULE)
    proc = subprocess.run([sys.executable, "-m", "integration_tests.support.verl_v1_driver", case], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT_JSON ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT_JSON "))


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(core_algos.__file__), "v1")),
                    reason="verl < 0.9 has no V1 trainer (verl.trainer.ppo.v1)")
def test_verls_v1_driver_step_runs_our_correction_before_grpo():
    """verl's own PPOTrainer._compute_advantage (V1 trainer), its TransferQueue calls answered by a dict."""
    result = _driver_step("decoupled")
    assert result["patched"]  # the module-level import in trainer_base sees our hook
    assert result["mask_equal"] and result["weights_max_diff"] < 1e-6
    assert result["rejected_rows"] == [1, 6]
    assert result["adv_max_diff"] < 1e-5  # GRPO over the kept siblings only
    assert result["metrics_equal"] and "rollout_corr/rollout_rs_seq_masked_fraction" in result["metric_keys"]
    assert result["sampler_old_used"]  # r_corr read pi_old's processed view from the TransferQueue
    bypass = _driver_step("bypass")
    assert bypass["mask_equal"] and bypass["rejected_rows"] and bypass["adv_max_diff"] < 1e-5
    assert bypass["old_is_rollout"]  # the loss will see pi_rollout as old_log_probs


@pytest.mark.skipif(importlib.util.find_spec("verl.trainer.main_ppo_sync") is None,
                    reason="verl >= 0.9 has no main_ppo_sync (its V1 trainer replaced it)")
def test_verl_08s_main_ppo_sync_driver_step_runs_our_correction_before_grpo():
    """verl 0.8's TransferQueue trainer (its PPOTrainer._compute_advantage), decoupled with the full pi_old."""
    result = _driver_step("decoupled_full")
    assert result["trainer"] == "verl.trainer.main_ppo_sync"
    assert result["patched"]  # main_ppo_sync's by-name import of verl's helper is our hook
    assert result["mask_equal"] and result["weights_max_diff"] < 1e-6
    assert result["rejected_rows"] == [1, 6]
    assert result["adv_max_diff"] < 1e-5  # GRPO over the kept siblings only
    assert result["metrics_equal"] and "rollout_corr/rollout_rs_seq_masked_fraction" in result["metric_keys"]


# ============================================================================= packaging

def test_missing_verl_is_an_import_error_naming_the_extra():
    code = ("import sys; sys.modules['verl'] = None\n"
            "try:\n    import rollout_parity.adapters.verl\nexcept ImportError as e:\n    print('MSG', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install rollout-parity[verl]" in proc.stdout, proc.stderr[-2000:]


#: verl >= 0.9 imports the ``verl.plugins`` entry points at ``import verl``; verl 0.8 only VERL_USE_EXTERNAL_MODULES.
needs_verl_plugins = pytest.mark.skipif(
    "_plugins_policy" not in vars(importlib.import_module("verl")),
    reason="verl < 0.9 loads no verl.plugins entry points at import verl (VERL_USE_EXTERNAL_PLUGINS)")


def _import_verl_with_a_broken_adapter(argv, **env):
    """``import verl`` in a fresh process whose adapter cannot import (a room missing), the adapter reached only
    through verl's ``verl.plugins`` entry point, as on verl 0.9 without ``VERL_USE_EXTERNAL_MODULES``."""
    assert "rollout_parity" in {ep.name for ep in importlib.metadata.entry_points(group="verl.plugins")}
    code = ("import sys\n"
            "sys.modules['rollout_parity.adapters.verl.compat'] = None  # the room cannot be imported\n"
            f"sys.argv = {['main_ppo', *argv]!r}\n"
            "import verl\n"
            "print('VERL_IMPORTED', 'rollout_parity.adapters.verl.patches' in sys.modules)\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", adapter.ENV_CONFIG)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**clean, "PYTHONPATH": str(REPO), **env})


@needs_verl_plugins
def test_a_driver_whose_plugin_import_fails_stops_naming_the_fix():
    """verl logs a failed ``verl.plugins`` import at DEBUG only, so ``+rollout_parity.*`` overrides would be ignored:
    a driver whose command line sets them stops at ``import verl``, naming the cause and the fix."""
    proc = _import_verl_with_a_broken_adapter(["+rollout_parity.preset=tis_srs_k3", "trainer.nnodes=1"])
    assert proc.returncode == 1 and "VERL_IMPORTED" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    err = proc.stderr
    assert "[rollout-parity] ERROR: rollout-parity's verl adapter (rollout_parity.adapters.verl) failed to import" in err
    assert "rollout_parity.adapters.verl.compat" in err  # the cause
    assert "+rollout_parity.preset=tis_srs_k3" in err and "trains uncorrected" in err
    assert "pip install 'rollout-parity[verl]'" in err and "on every node" in err


@needs_verl_plugins
def test_a_ray_process_of_a_configured_job_whose_plugin_import_fails_stops_too():
    """A worker on a node where the adapter cannot import, in a job that carries the flags (its env): the same."""
    proc = _import_verl_with_a_broken_adapter([], **{adapter.ENV_CONFIG: json.dumps(CorrectionConfig().to_dict())})
    assert proc.returncode == 1 and "VERL_IMPORTED" not in proc.stdout
    assert f"configured with rollout-parity's flags ({adapter.ENV_CONFIG} is set)" in proc.stderr, proc.stderr[-3000:]


@needs_verl_plugins
def test_without_the_flags_a_failed_plugin_import_is_a_warning_and_verl_goes_on():
    proc = _import_verl_with_a_broken_adapter(["trainer.nnodes=1"])
    assert proc.returncode == 0 and "VERL_IMPORTED False" in proc.stdout, proc.stderr[-3000:]
    assert "rollout-parity's verl adapter (rollout_parity.adapters.verl) failed to import" in proc.stderr
    assert "verl runs without it" in proc.stderr and "pip install 'rollout-parity[verl]'" in proc.stderr


def test_a_process_on_a_node_without_the_package_fails_at_import_verl(tmp_path):
    """Every Ray process of a configured job imports the adapter through ``VERL_USE_EXTERNAL_MODULES`` (which the
    adapter hands to the job): where rollout-parity is not installed, verl's own import of that variable fails
    uncaught, naming the package, instead of the process running without the correction."""
    missing = tmp_path / "node_without_it" / "rollout_parity"
    missing.mkdir(parents=True)  # shadows every installed copy, as if the package were absent
    (missing / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'rollout_parity'\", name='rollout_parity')\n")
    env = {**os.environ, "PYTHONPATH": str(missing.parent), "VERL_USE_EXTERNAL_MODULES": adapter.MODULE,
           adapter.ENV_CONFIG: json.dumps(CorrectionConfig.preset("tis_srs_k3").to_dict())}
    proc = subprocess.run([sys.executable, "-c", "import verl; print('VERL_IMPORTED')"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0 and "VERL_IMPORTED" not in proc.stdout
    assert "ModuleNotFoundError: No module named 'rollout_parity'" in proc.stderr, proc.stderr[-3000:]


def test_the_example_command_line_passes_verls_validation():
    """examples/verl_ppo.sh: its overrides compose, configure and pass verl's own validate_config."""
    import re
    import shlex

    import verl.utils.config as verl_config
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    script = (REPO / "examples" / "verl_ppo.sh").read_text()
    command = script[script.index("python3 -m verl.trainer.main_ppo"):].split('"$@"')[0]
    command = command.replace("$DATA", "/data/gsm8k").replace("$MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    overrides = [tok for tok in shlex.split(re.sub(r"\\\n", " ", command))[3:]]
    ours = dict(tok[len("+rollout_parity."):].split("=", 1) for tok in overrides if tok.startswith("+rollout_parity."))
    assert ours == {"rollout_importance_sampling_mode": "token_truncate"}  # the example's one flag, no rejection
    config = compose_verl(*overrides, base=False)
    try:
        verl_config.validate_config(config, use_reference_policy=need_reference_policy(config),
                                    use_critic=need_critic(config))
        assert adapter.active_config() == CorrectionConfig(rollout_importance_sampling_mode="token_truncate")
    finally:
        adapter.set_active_config(None)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
