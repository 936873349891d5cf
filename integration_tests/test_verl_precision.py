"""The ``precision`` flag through the verl adapter, against verl's own config classes and its own FSDP actor.

* verl's own ``ppo_trainer`` / ``ppo_megatron_trainer`` Hydra config with ``+rollout_parity.precision=...``,
  through the adapter's config path: every dtype key verl 0.9.1 reads (the FSDP engine's
  ``mixed_precision.param_dtype``, the ``fsdp_config.dtype`` its YAML names, Megatron's ``megatron.dtype``,
  ``rollout.dtype`` and the recipe's ``engine_kwargs.vllm.dtype``) carries the one value, and verl's own
  dataclasses (``omega_conf_to_dataclass``: ``FSDPActorConfig``, ``FSDPEngineConfig``, ``McoreEngineConfig``,
  ``RolloutConfig``) build from it, verl's ``PrecisionType`` reading the dtype the flag names;
* a contradicting key the user set is refused by name (nothing written), a YAML default overwritten and said;
* without the flag, an actor and an engine in different dtypes are one warning naming both, never a refusal;
* one update of verl's own FSDP actor on CPU in fp16 and in bf16 (``support/verl_actor_step_precision.py``):
  the fp32 head and the correction work unchanged, the two runs compared only with each other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rollout_parity.testing.stack import need

need("verl", extra="verl")

from omegaconf import OmegaConf, open_dict  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.torch_dtypes import PrecisionType  # noqa: E402

from integration_tests.support.spread import bound  # noqa: E402
from rollout_parity.adapters import verl as adapter  # noqa: E402
from rollout_parity.adapters.verl import precision as verl_precision  # noqa: E402
from rollout_parity.core.precision import engine_dtype, torch_dtype  # noqa: E402

from .support.verl_configs import BASE_OVERRIDES, compose_verl  # noqa: E402

pytestmark = [pytest.mark.verl]

REPO = Path(__file__).resolve().parents[1]
AR = "actor_rollout_ref."
#: what verl's own validate_config needs of a run (as the adapter tests give it)
VALID_RUN = ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
             "algorithm.adv_estimator=grpo", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "trainer.n_gpus_per_node=1"]
FLAG = "+rollout_parity.rollout_importance_sampling_mode=token_truncate"


@pytest.fixture(autouse=True)
def _clean():
    verl_precision._warned.clear()
    yield
    adapter.set_active_config(None)
    verl_precision._warned.clear()


def _compose(config_name, *overrides, hydra_config=False):
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo import core_algos

    config_dir = os.path.abspath(os.path.join(os.path.dirname(core_algos.__file__), "..", "config"))
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra_config)


@contextlib.contextmanager
def on_the_command_line(*overrides):
    """verl's ``ppo_trainer`` as ``hydra.main`` hands it over: Hydra's own run config set, so
    ``HydraConfig.get().overrides.task`` lists ``overrides`` (what the adapter reads as the user's keys)."""
    from hydra.core.hydra_config import HydraConfig

    full = _compose("ppo_trainer", *BASE_OVERRIDES, *overrides, hydra_config=True)
    HydraConfig.instance().set_config(full)
    try:
        with open_dict(full):
            del full["hydra"]  # hydra.main hands the task config without it
        yield full
    finally:
        HydraConfig.instance().cfg = None


def ref_engine_config(config):
    """verl's ref engine config as its ``ActorRolloutRefWorker`` builds it (``verl/workers/engine_workers.py``
    545-553: the log-prob keys renamed, then ``omega_conf_to_dataclass`` of the ref block)."""
    ref = OmegaConf.create(OmegaConf.to_container(config.actor_rollout_ref.ref, resolve=True))
    actor = config.actor_rollout_ref.actor
    with open_dict(ref):
        ref.ppo_mini_batch_size = actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    return omega_conf_to_dataclass(ref).engine


# ============================================================================= what the flag writes


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_the_flag_writes_every_dtype_key_verls_fsdp_run_reads_and_verls_classes_read_it_back(precision, capsys):
    import verl.utils.config as verl_config

    config = compose_verl(FLAG, f"+rollout_parity.precision={precision}", *VALID_RUN)
    cfg = adapter.configure_verl(config)
    assert cfg.precision == precision
    ar = config.actor_rollout_ref
    # verl's own dataclasses build from what we wrote, and verl's PrecisionType reads the flag's dtype
    actor = omega_conf_to_dataclass(ar.actor)
    for engine in (actor.fsdp_config, ref_engine_config(config)):
        assert type(engine).__name__ == "FSDPEngineConfig"
        assert PrecisionType.to_dtype(engine.mixed_precision["param_dtype"]) == torch_dtype(precision)
        assert PrecisionType.to_dtype(engine.dtype) == torch_dtype(precision)
        assert engine.mixed_precision.get("reduce_dtype") is None  # verl's fp32 reduce stays
    rollout = omega_conf_to_dataclass(ar.rollout)
    assert rollout.dtype == engine_dtype(precision) == rollout.engine_kwargs["vllm"]["dtype"]
    # the recipe's engine kwargs are the core recipe with the same dtype, nothing else changed
    from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs

    assert OmegaConf.to_container(ar.rollout.engine_kwargs.vllm) == vllm_parity_kwargs(precision=precision)
    # verl's own start-of-run check passes on the rewrite
    verl_config.validate_config(config, use_reference_policy=True, use_critic=False)
    out = capsys.readouterr().out
    if precision != "bf16":  # verl's YAML says bfloat16: overwritten, and said where it shows
        assert f"actor_rollout_ref.rollout.dtype: 'bfloat16' -> '{engine_dtype(precision)}'" in out
        assert f"actor_rollout_ref.actor.fsdp_config.dtype: 'bfloat16' -> '{engine_dtype(precision)}'" in out
    snapshot = OmegaConf.to_container(config)
    adapter.configure_verl(config)  # configuring twice changes nothing
    assert OmegaConf.to_container(config) == snapshot


def test_without_the_flag_nothing_dtype_is_written():
    config = compose_verl(FLAG)
    before = OmegaConf.to_container(config.actor_rollout_ref)
    adapter.configure_verl(config)
    ar = config.actor_rollout_ref
    assert "dtype" not in ar.rollout.engine_kwargs.vllm and "mixed_precision" not in ar.actor.fsdp_config
    assert ar.rollout.dtype == before["rollout"]["dtype"] == ar.actor.fsdp_config.dtype == "bfloat16"


def test_the_megatron_strategy_gets_megatrons_dtype_key_and_verls_mcore_config_accepts_it():
    config = _compose("ppo_megatron_trainer", FLAG, "+rollout_parity.precision=fp16",
                      "actor_rollout_ref.rollout.name=vllm")
    assert config.actor_rollout_ref.actor.strategy == "megatron"
    adapter.configure_verl(config)
    ar = config.actor_rollout_ref
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # McoreEngineConfig notes that TP 1 turns sequence parallel off
        actor = omega_conf_to_dataclass(ar.actor.megatron)
        ref = omega_conf_to_dataclass(ar.ref.megatron)
    for engine in (actor, ref):
        assert type(engine).__name__ == "McoreEngineConfig"
        assert PrecisionType.to_dtype(engine.dtype) == torch.float16
    assert "fsdp_config" not in ar.actor or "mixed_precision" not in ar.actor.get("fsdp_config", {})
    assert omega_conf_to_dataclass(ar.rollout).dtype == "float16" == ar.rollout.engine_kwargs.vllm.dtype


def test_fp32_on_megatron_is_refused_as_verls_own_mcore_config_would():
    config = _compose("ppo_megatron_trainer", FLAG, "+rollout_parity.precision=fp32",
                      "actor_rollout_ref.rollout.name=vllm")
    with pytest.raises(ValueError, match=r"precision='fp32' with actor_rollout_ref\.actor\.strategy='megatron'.*"
                                         r"bfloat16 or float16 only.*precision=bf16 or fp16"):
        adapter.configure_verl(config)
    assert adapter.active_config() is None
    # verl's own class refuses the same value (an assertion deep in a worker, where we refuse at start)
    megatron = OmegaConf.create(OmegaConf.to_container(config.actor_rollout_ref.actor.megatron, resolve=True))
    megatron.dtype = "float32"
    with pytest.raises(Exception, match="dtype float32 not supported"):
        omega_conf_to_dataclass(megatron)


# ============================================================================= refusals


@pytest.mark.parametrize("override, key", [
    ("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
     "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype='bf16'"),
    ("+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
     "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype='fp32'"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.dtype=bfloat16",
     "actor_rollout_ref.rollout.engine_kwargs.vllm.dtype='bfloat16'"),
])
def test_a_key_only_the_user_sets_that_contradicts_is_refused_by_name(override, key):
    """Keys verl's YAML never sets: any contradicting value is the user's, refused wherever it was given."""
    config = compose_verl(FLAG, "+rollout_parity.precision=fp16", override)
    before = OmegaConf.to_container(config)
    with pytest.raises(ValueError) as err:
        adapter.configure_verl(config)
    message = str(err.value)
    assert message.startswith(f"{key} contradicts rollout_parity.precision='fp16'")
    assert "drop the" in message and "set rollout_parity.precision to the dtype you want on both sides" in message
    assert adapter.active_config() is None and OmegaConf.to_container(config) == before


@pytest.mark.parametrize("key", [AR + "rollout.dtype", AR + "actor.fsdp_config.dtype", AR + "ref.fsdp_config.dtype"])
def test_verls_yaml_key_set_on_the_command_line_against_the_flag_is_refused(key):
    with on_the_command_line(FLAG, "+rollout_parity.precision=fp16", f"{key}=bfloat16") as config:
        with pytest.raises(ValueError, match=rf"^{key}='bfloat16' contradicts rollout_parity\.precision='fp16'"):
            adapter.configure_verl(config)
    assert adapter.active_config() is None


def test_the_same_value_on_the_command_line_is_fine():
    with on_the_command_line(FLAG, "+rollout_parity.precision=fp16", AR + "rollout.dtype=float16",
                             AR + "actor.fsdp_config.dtype=fp16") as config:
        assert adapter.configure_verl(config).precision == "fp16"
    assert config.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp16"


def test_a_strategy_the_flag_does_not_cover_is_refused_by_name():
    config = compose_verl(FLAG, "+rollout_parity.precision=fp16", "actor_rollout_ref.actor.strategy=veomni")
    with pytest.raises(ValueError, match=r"precision='fp16' with actor_rollout_ref\.actor\.strategy='veomni'"):
        adapter.configure_verl(config)


def test_a_real_main_ppo_command_line_refuses_a_contradicting_dtype_before_ray(tmp_path):
    """Hydra's real command line: the key the user typed is refused (verl's dtype key set to bf16 with the fp16
    flag), by name, before Ray starts."""
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES=adapter.MODULE, HYDRA_FULL_ERROR="1")
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *BASE_OVERRIDES, *VALID_RUN, FLAG,
                           "+rollout_parity.precision=fp16", "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",
                           f"hydra.run.dir={tmp_path}"], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode != 0
    assert ("actor_rollout_ref.actor.fsdp_config.dtype='bfloat16' contradicts rollout_parity.precision='fp16'"
            in proc.stderr), proc.stderr[-3000:]
    assert "ray init kwargs" not in proc.stdout


# ============================================================================= the warning without the flag


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == verl_precision.__name__]


@pytest.mark.parametrize("block", [False, True])
def test_one_side_set_without_the_flag_is_warned_once_naming_both_keys(caplog, block):
    overrides = ["+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16"] + ([FLAG] if block else [])
    config = compose_verl(*overrides)
    before = OmegaConf.to_container(config.actor_rollout_ref)
    with caplog.at_level(logging.WARNING, logger=verl_precision.__name__):
        cfg = adapter.configure_verl(config)
        adapter.configure_verl(config)  # verl calls two of our hooks: still one warning
    assert (cfg is not None) is block  # warned, never refused
    (message,) = _warnings(caplog)
    assert "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype='fp16'" in message
    assert "actor_rollout_ref.rollout.dtype='bfloat16'" in message
    assert "`rollout-parity doctor` measures what it costs" in message and "p/mixed" in message
    if not block:
        assert OmegaConf.to_container(config.actor_rollout_ref) == before


def test_verls_yaml_dtype_key_alone_is_named_for_what_verls_engine_computes_in(caplog):
    """``fsdp_config.dtype=float16`` (the key verl's YAML names) with an fp16 engine: verl 0.9's FSDP engine
    reads ``mixed_precision.param_dtype`` only (bf16 while unset), so the two sides differ; the warning says
    so. That verl's engine computes in bf16 here is measured on its own actor in the CPU-step test below."""
    with caplog.at_level(logging.WARNING, logger=verl_precision.__name__):
        adapter.configure_verl(compose_verl(AR + "actor.fsdp_config.dtype=float16", AR + "rollout.dtype=float16"))
    (message,) = _warnings(caplog)
    assert "the actor computes in bf16" in message and "vLLM engine in fp16" in message
    assert "actor_rollout_ref.actor.fsdp_config.dtype='float16'" in message


@pytest.mark.parametrize("overrides", [[], [AR + "rollout.dtype=bfloat16"], [FLAG, "+rollout_parity.precision=fp16"],
                                       [AR + "actor.strategy=megatron"]])
def test_matching_sides_or_the_flag_say_nothing(caplog, overrides):
    with caplog.at_level(logging.WARNING, logger=verl_precision.__name__):
        adapter.configure_verl(compose_verl(*overrides))
    assert not _warnings(caplog)


def test_the_engine_kwargs_dtype_is_the_engines_dtype_for_the_warning(caplog):
    """verl passes ``engine_kwargs.vllm`` after its own ``dtype`` (vllm_async_server.py): that one is the engine's."""
    with caplog.at_level(logging.WARNING, logger=verl_precision.__name__):
        adapter.configure_verl(compose_verl("+actor_rollout_ref.rollout.engine_kwargs.vllm.dtype=float16"))
    (message,) = _warnings(caplog)
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.dtype='float16'" in message


# ============================================================================= verl's own FSDP actor on CPU


def _step(*args):
    env = dict(os.environ, MASTER_PORT=str(29900 + (os.getpid() % 90)), VERL_USE_EXTERNAL_MODULES=adapter.MODULE)
    proc = subprocess.run([sys.executable, "-m", "integration_tests.support.verl_actor_step_precision", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT_JSON ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT_JSON "))


@pytest.mark.slow
def test_one_update_of_verls_fsdp_actor_in_fp16_against_the_same_step_in_bf16():
    """verl's TrainingWorker built from the config the flag rewrote: it computes in the flag's dtype, the fp32 head
    and the correction work as in bf16, and fp16 lands closer to the model in fp64 (10 mantissa bits to 7).
    Every number is compared with the same step's bf16 run, never with a number of this machine."""
    fp16 = _step("fp16", "--cpu-scaler", "--declared-only")
    bf16 = _step("bf16")
    for run, precision in ((fp16, "fp16"), (bf16, "bf16")):
        assert run["precision"] == precision and run["engine"] == "FSDPEngineWithLMHead"
        name = engine_dtype(precision)
        assert run["written"] == {"actor.fsdp_config.dtype": name, "actor.fsdp_config.mixed_precision.param_dtype":
                                  precision, "rollout.dtype": name, "rollout.engine_kwargs.vllm.dtype": name}
        # verl's engine computes in the flag's dtype: its autocast and the body's hidden states
        assert run["autocast_dtype"] == run["hidden_dtype"] == f"torch.{name}"
        # the fp32 head, applied at verl's model build, projects in fp32 in both
        assert run["fp32_head_applied_at_build"] and run["head_output_dtype"] == "torch.float32"
        assert run["rejected_tokens"] > 0 and run["kept_tokens"] > 0
    # fp16 makes verl's grad scaler (here on CPU, --cpu-scaler): the update ran through the scaled backward
    assert fp16["scaler"] == "ShardedGradScaler" and fp16["scaler_enabled"] and fp16["scale_after_step"] > 1
    assert bf16["scaler"] is None
    # The values beside the bounds: batch seeds 3 + (0, 1, 2, 4) (spread.seed(), read by the support process).
    # The fp32 head's own error (against an fp64 head over the same hidden states) stays at fp32's level in both:
    # x100 it is 0.16-0.24 of the rounding the fp16 body leaves (4x under), and fp16's / bf16's is 1.4-2.5 (4x under)
    assert bound("fp16: fp32-head error x 100 / body rounding", fp16["head_err_vs_fp64_head"] * 100
                 / fp16["logprob_err_vs_fp64_model"], "<", 1.0)
    assert bound("fp32-head error, fp16 / bf16", fp16["head_err_vs_fp64_head"] / bf16["head_err_vs_fp64_head"],
                 "<", 10.0)
    # what fp16 is for: verl's logprobs closer to the model in fp64 than bf16's (fp16's / bf16's 0.13-0.21, 2.4x under)
    assert bound("logprob error vs fp64 model, fp16 x 2 / bf16", 2 * fp16["logprob_err_vs_fp64_model"]
                 / bf16["logprob_err_vs_fp64_model"], "<", 1.0)
    # the update through verl's loss and our wrapper (and, in fp16, verl's grad scaler) lands nearer the core's than
    # in bf16: |verl - core| / |core| fp16's / bf16's 0.13-0.18 (2.8x under), 1 - cosine 0.026-0.068 (3.7x under)
    assert bound("update error vs the core, fp16 x 2 / bf16", 2 * fp16["update_rel_err"] / bf16["update_rel_err"],
                 "<", 1.0)
    assert bound("1 - cosine, fp16 x 4 / bf16", 4 * (1 - fp16["update_cosine"]) / (1 - bf16["update_cosine"]),
                 "<", 1.0)
    assert fp16["moved"] > 0 and bf16["moved"] > 0
    assert fp16["metric_keys"] == bf16["metric_keys"]
    assert {"rollout_correction/loss_contrib_pos", "rollout_correction/loss_nonfinite_frac"} <= set(fp16["metric_keys"])
    # without the flag, verl's YAML keys alone (fsdp_config.dtype, rollout.dtype = float16): verl's engine computes
    # in bf16 with no scaler, and the adapter's one warning says so
    declared = fp16["declared_only"]
    assert declared["autocast_dtype"] == "torch.bfloat16" and declared["scaler"] is None
    (warning,) = declared["warnings"]
    assert "the actor computes in bf16" in warning and "actor_rollout_ref.rollout.dtype='float16'" in warning


def _vllm_refusal(model_type: str) -> str:
    """vLLM's own words for a model type it refuses in float16 (``_check_valid_dtype``, the engine's check)."""
    from vllm.config.model import _check_valid_dtype

    with pytest.raises(ValueError) as refused:
        _check_valid_dtype(model_type, torch.float16)
    return str(refused.value).split("Reason: ", 1)[1]


def test_a_model_type_vllm_refuses_in_fp16_is_refused_by_name_before_ray(tmp_path):
    """vLLM refuses gemma2 in float16 when its engine builds, minutes into the run; the flag names it at start."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    config = compose_verl(FLAG, "+rollout_parity.precision=fp16", f"actor_rollout_ref.model.path={tmp_path}")
    with pytest.raises(ValueError) as refused:
        adapter.configure_verl(config)
    assert str(refused.value) == (
        "rollout_parity.precision: 'fp16' with actor_rollout_ref.model.path of model type 'gemma2', which vLLM "
        f"refuses in float16 ({_vllm_refusal('gemma2')}); keep precision bf16 (or null) for this model")
    assert adapter.active_config() is None
    bf16 = compose_verl(FLAG, "+rollout_parity.precision=bf16", f"actor_rollout_ref.model.path={tmp_path}")
    assert adapter.configure_verl(bf16).precision == "bf16"  # the same model in bf16 is fine
    adapter.set_active_config(None)
