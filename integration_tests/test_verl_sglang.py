"""verl with ``actor_rollout_ref.rollout.name=sglang``: the adapter writes SGLang's recipe through verl's own
``engine_kwargs.sglang``, verl's config classes accept the result, and what verl's SGLang path cannot carry is
refused by name before anything loads.

Against verl 0.9.1's own Hydra config and dataclasses (``omega_conf_to_dataclass``) and its own SGLang server
source (the incompatibilities with newer SGLang releases are read from it, not assumed). That the kwargs pass
SGLang's own validation with verl's GPU defaults runs in SGLang's venv: ``test_sglang_server_args.py``.
"""

from __future__ import annotations

import json

import pytest

from rollout_parity.testing.stack import need

need("verl", extra="verl")

from omegaconf import OmegaConf  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402

from rollout_parity import CorrectionConfig  # noqa: E402
from rollout_parity.adapters import verl as adapter  # noqa: E402
from rollout_parity.adapters.verl import engine as verl_engine  # noqa: E402
from rollout_parity.engines.sglang.recipe import sglang_parity_kwargs  # noqa: E402
from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs  # noqa: E402

from .support.verl_configs import compose_verl  # noqa: E402

pytestmark = pytest.mark.verl
SGLANG = "actor_rollout_ref.rollout.name=sglang"


@pytest.fixture(autouse=True)
def _clear():
    yield
    adapter.set_active_config(None)


def test_sglang_rollout_gets_the_recipe_through_its_engine_kwargs():
    config = compose_verl(SGLANG, "+rollout_parity.rollout_importance_sampling_mode=token_truncate",
                          "+rollout_parity.fp32_lm_head=true", "actor_rollout_ref.rollout.top_p=0.9",
                          "actor_rollout_ref.rollout.top_k=20")
    cfg = adapter.configure_verl(config)
    assert cfg.fp32_lm_head and cfg.rollout_importance_sampling_mode == "token_truncate"
    rollout = config.actor_rollout_ref.rollout
    assert OmegaConf.to_container(rollout.engine_kwargs.sglang) == sglang_parity_kwargs(fp32_lm_head=True) == {
        "disable_overlap_schedule": True, "disable_radix_cache": True, "enable_fp32_lm_head": True}
    assert not rollout.engine_kwargs.get("vllm"), "no vLLM kwargs for an SGLang rollout"
    assert rollout.calculate_log_probs is True
    # SGLang returns log_softmax(logits / T): verl's own pi_old pass is already that form, never sampler-aware
    env = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert adapter.ENV_SAMPLER not in env and adapter.active_sampler() is None
    assert CorrectionConfig.from_dict(json.loads(env[adapter.ENV_CONFIG])) == cfg
    built = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)  # verl's RolloutConfig accepts it
    assert built.name == "sglang" and built.engine_kwargs["sglang"]["enable_fp32_lm_head"] is True


def test_the_same_flags_under_vllm_are_sampler_aware():
    """The difference the engine makes: vLLM's processed logprobs need the sampler-aware pi_old."""
    config = compose_verl("+rollout_parity.rollout_importance_sampling_mode=token_truncate",
                          "actor_rollout_ref.rollout.top_p=0.9")
    adapter.configure_verl(config)
    assert adapter.active_sampler() is not None
    assert OmegaConf.to_container(config.actor_rollout_ref.rollout.engine_kwargs.vllm) == vllm_parity_kwargs()


def test_precision_writes_sglangs_dtype():
    config = compose_verl(SGLANG, "+rollout_parity.rollout_importance_sampling_mode=token_truncate",
                          "+rollout_parity.precision=fp16")
    adapter.configure_verl(config)
    rollout = config.actor_rollout_ref.rollout
    assert rollout.engine_kwargs.sglang.dtype == "float16" and rollout.dtype == "float16"
    assert "vllm" not in (rollout.engine_kwargs or {}) or not rollout.engine_kwargs.vllm


@pytest.mark.parametrize("overrides, message", [
    (["+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_overlap_schedule=false"],
     r"engine_kwargs\.sglang\.disable_overlap_schedule=False contradicts the parity recipe"),
    (["+actor_rollout_ref.rollout.engine_kwargs.sglang.dtype=float32", "+rollout_parity.precision=bf16"],
     r"engine_kwargs\.sglang\.dtype='float32' contradicts rollout_parity\.precision='bf16'"),
    (["+rollout_parity.weight_sync_check_interval=1"], "weight_sync_check_interval with actor_rollout_ref.rollout"),
])
def test_what_verls_sglang_path_cannot_carry_is_refused_by_name(overrides, message):
    config = compose_verl(SGLANG, "+rollout_parity.rollout_importance_sampling_mode=token_truncate", *overrides)
    before = OmegaConf.to_container(config)
    with pytest.raises(ValueError, match=message):
        adapter.configure_verl(config)
    assert OmegaConf.to_container(config) == before  # nothing written


@pytest.mark.parametrize("version, message", [
    ("0.5.20", "reads ServerArgs with dataclasses.fields, which SGLang 0.5.20 refuses"),
    ("0.5.23", "reads ServerArgs with dataclasses.fields, which SGLang 0.5.23 refuses"),
])
def test_an_sglang_this_verl_cannot_launch_is_refused_from_verls_own_source(monkeypatch, version, message):
    """verl 0.9.1's server calls ``dataclasses.fields(ServerArgs)``: read from its installed source."""
    source = verl_engine._verl_sglang_source()
    assert source is not None and "dataclasses.fields(ServerArgs" in source.replace(" ", "")
    monkeypatch.setattr("rollout_parity.engines.sglang.features.installed_sglang_version", lambda: version)
    config = compose_verl(SGLANG, "+rollout_parity.rollout_importance_sampling_mode=token_truncate")
    with pytest.raises(ValueError, match=message):
        adapter.configure_verl(config)
    monkeypatch.setattr("rollout_parity.engines.sglang.features.installed_sglang_version", lambda: "0.5.12")
    adapter.configure_verl(config)  # the release verl pins: accepted


def test_a_verl_that_never_opens_a_weight_update_session_is_refused_on_sglang_0_5_21(monkeypatch):
    """Past the launch: with a verl source that builds ServerArgs another way, SGLang >= 0.5.21's weight-update
    session (never opened by verl 0.9.1) is the next refusal."""
    source = verl_engine._verl_sglang_source()
    assert "begin_weight_update" not in source
    monkeypatch.setattr(verl_engine, "_verl_sglang_source", lambda: source.replace("dataclasses.fields", "fields_of"))
    monkeypatch.setattr("rollout_parity.engines.sglang.features.installed_sglang_version", lambda: "0.5.21")
    config = compose_verl(SGLANG, "+rollout_parity.rollout_importance_sampling_mode=token_truncate")
    with pytest.raises(ValueError, match=r"between begin_weight_update\(\) and end_weight_update\(\)"):
        adapter.configure_verl(config)


def test_logprobs_before_the_temperature_are_refused_where_the_servers_would_see_them(monkeypatch):
    """``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` in the job's env vars (or the driver's environment, which the server
    actors inherit) at a temperature other than 1: SGLang would return logprobs before the temperature."""
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    env = "+ray_kwargs.ray_init.runtime_env.env_vars.SGLANG_RETURN_ORIGINAL_LOGPROB=1"
    config = compose_verl(SGLANG, "+rollout_parity.rollout_importance_sampling_mode=token_truncate", env,
                          "actor_rollout_ref.rollout.temperature=0.7")
    with pytest.raises(ValueError, match=r"SGLANG_RETURN_ORIGINAL_LOGPROB=1 with temperature 0.7"):
        adapter.configure_verl(config)
    at_one = compose_verl(SGLANG, "+rollout_parity.rollout_importance_sampling_mode=token_truncate", env,
                          "actor_rollout_ref.rollout.temperature=1.0")
    adapter.configure_verl(at_one)  # the same logprobs either way at T = 1
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=1 with temperature 0.7"):
        adapter.configure_verl(compose_verl(SGLANG, "+rollout_parity.rollout_importance_sampling_mode=token_truncate",
                                            "actor_rollout_ref.rollout.temperature=0.7"))


def test_an_sglang_outside_the_releases_that_ran_is_warned_about_once(monkeypatch):
    from rollout_parity import framework_api

    monkeypatch.setattr(framework_api, "_warned", set())
    monkeypatch.setattr(framework_api, "installed_version", lambda dists: "0.5.11" if "sglang" in dists else None)
    monkeypatch.setattr("rollout_parity.engines.sglang.features.installed_sglang_version", lambda: "0.5.11")
    config = compose_verl(SGLANG, "+rollout_parity.rollout_importance_sampling_mode=token_truncate")
    untested = r"SGLang >=0\.5\.12,<0\.5\.24; the installed 0\.5\.11"
    with pytest.warns(framework_api.UntestedFrameworkVersionWarning, match=untested):
        adapter.configure_verl(config)


def test_a_precision_set_on_one_side_names_the_sglang_engine(caplog):
    """Without the flag: an actor in bf16 and an SGLang engine told float16 through its own engine kwargs get one
    warning naming SGLang and the key (engine_kwargs.sglang.dtype wins over rollout.dtype in verl's server)."""
    import logging

    from rollout_parity.adapters.verl import precision as verl_precision

    config = compose_verl(SGLANG, "+actor_rollout_ref.rollout.engine_kwargs.sglang.dtype=float16")
    with caplog.at_level(logging.WARNING, logger=verl_precision.__name__):
        message = verl_precision.warn_one_sided_precision(config)
    assert message is not None and "the SGLang engine in fp16" in message
    assert "actor_rollout_ref.rollout.engine_kwargs.sglang.dtype='float16'" in message


def test_the_doctors_sglang_lines_configure_verls_sglang_rollout():
    """``rollout-parity doctor --engine sglang`` prints verl's lines with ``rollout.name=sglang``: composed with
    verl's own config they give the same flags and SGLang's recipe in its engine kwargs."""
    from rollout_parity.doctor.advice import framework_lines

    cfg = CorrectionConfig.preset("tis_srs_k3", fp32_lm_head=True, rollout_rejection=["seq_mean_k3"],
                                  rollout_rejection_threshold=1e-4)
    lines = framework_lines(cfg, "sglang")
    assert set(lines) == {"verl"}  # TRL and NeMo RL roll out with vLLM only here
    overrides = [line.strip() for line in lines["verl"].split("\\\n")]
    assert overrides[0] == SGLANG
    config = compose_verl(*overrides)
    assert adapter.configure_verl(config) == cfg
    rollout = config.actor_rollout_ref.rollout
    assert rollout.name == "sglang"
    assert OmegaConf.to_container(rollout.engine_kwargs.sglang) == sglang_parity_kwargs(fp32_lm_head=True)
    assert not framework_lines(cfg)["verl"].startswith("    actor_rollout_ref.rollout.name")  # vLLM: verl's default


def test_a_hierarchical_cache_beside_the_recipes_radix_cache_off_is_refused_before_anything_loads():
    """SGLang refuses the pair at launch (test_sglang_server_args.py); the adapter names it at configure time."""
    config = compose_verl(SGLANG, "+rollout_parity.rollout_importance_sampling_mode=token_truncate",
                          "+actor_rollout_ref.rollout.engine_kwargs.sglang.enable_hierarchical_cache=true")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.engine_kwargs\.sglang\.enable_hierarchical_cache"
                                         r"=True needs SGLang's radix cache"):
        adapter.configure_verl(config)
    assert OmegaConf.to_container(config.actor_rollout_ref.rollout.engine_kwargs.sglang) == {
        "enable_hierarchical_cache": True}, "nothing written"
