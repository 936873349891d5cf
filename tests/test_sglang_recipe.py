"""SGLang's side of the seam without SGLang: its release table, the recipe's server arguments and the live-engine
check on a ServerArgs-shaped record (the live engine: integration_tests/test_sglang_engine.py, in SGLang's venv).

The release table's rows were read from SGLang's own released sources; here each refusal names the release that
has the feature, each version spelling SGLang publishes parses in order, and each option of the recipe changes it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollout_parity.engines import spec
from rollout_parity.engines.sglang import features as sf
from rollout_parity.engines.sglang import recipe as sr


@pytest.mark.parametrize("older, newer", [("0.5.0rc2", "0.5.0"), ("0.5.4", "0.5.4.post1"),
                                          ("0.5.4.post1", "0.5.4.post3"), ("0.5.9", "0.5.10rc0"),
                                          ("0.5.10rc0", "0.5.10"), ("0.5.12", "0.5.12.post1"), ("0.5.19", "0.5.23+cpu")])
def test_sglang_versions_order_as_its_releases(older, newer):
    assert sf.parse_sglang_version(older) < sf.parse_sglang_version(newer)


def test_an_unparsable_version_is_named():
    with pytest.raises(ValueError, match="cannot parse an SGLang version from 'nightly'"):
        sf.parse_sglang_version("nightly")


@pytest.mark.parametrize("feature, before, since", [(f.name, None, f.since) for f in sf.SGLANG_FEATURES.values()])
def test_each_feature_starts_at_its_release(feature, before, since):
    assert sf.sglang_has(feature, since) and sf.sglang_has(feature, None)
    major, minor, patch, *_ = sf.parse_sglang_version(since)
    if patch:
        assert not sf.sglang_has(feature, f"{major}.{minor}.{patch - 1}")


def test_a_missing_feature_is_refused_by_name_with_its_release():
    with pytest.raises(sf.SglangFeatureMissingError, match=r"fp32_lm_head=True needs .* SGLang 0.5.2 lacks: it is in "
                                                           r"SGLang >= 0.5.3"):
        sr.sglang_parity_kwargs(fp32_lm_head=True, sglang_version="0.5.2")
    assert issubclass(sf.SglangFeatureMissingError, spec.EngineFeatureMissingError)
    with pytest.raises(KeyError, match="unknown SGLang feature 'cache_salt'"):
        sf.sglang_has("cache_salt", "0.5.23")


def test_the_recipe_per_option():
    assert sr.sglang_parity_kwargs(sglang_version="0.5.12") == {"disable_overlap_schedule": True,
                                                                "disable_radix_cache": True}
    assert sr.sglang_parity_kwargs(True, sglang_version="0.5.12")["enable_fp32_lm_head"] is True
    assert sr.sglang_parity_kwargs(prefix_cache_policy="reset", sglang_version="0.5.12")["disable_radix_cache"] is False
    assert sr.sglang_parity_kwargs(precision="fp16", sglang_version="0.5.23")["dtype"] == "float16"
    assert sr.sglang_parity_kwargs(sglang_version="0.5.23", mem_fraction_static=0.4)["mem_fraction_static"] == 0.4


def test_salt_and_a_contradicting_override_are_refused_by_name():
    with pytest.raises(ValueError, match="prefix_cache_policy='salt': SGLang has no per-request cache salt"):
        sr.sglang_parity_kwargs(prefix_cache_policy="salt")
    with pytest.raises(ValueError, match=r"disable_overlap_schedule=False contradicts the SGLang parity recipe"):
        sr.sglang_parity_kwargs(disable_overlap_schedule=False)


def test_a_radix_cache_extension_is_refused_where_the_recipe_turns_the_cache_off():
    with pytest.raises(ValueError, match="enable_hierarchical_cache=True needs SGLang's radix cache"):
        sr.sglang_parity_kwargs(enable_hierarchical_cache=True)
    cached = sr.sglang_parity_kwargs(prefix_cache_policy="reset", enable_hierarchical_cache=True)  # the cache is on
    assert cached["enable_hierarchical_cache"] is True and cached["disable_radix_cache"] is False
    assert sr.sglang_parity_kwargs(enable_hierarchical_cache=False)["enable_hierarchical_cache"] is False
    with pytest.raises(ValueError, match=r"^engine_kwargs\.sglang\.enable_hierarchical_cache=1 needs"):
        sr.refuse_contradictions(sr.sglang_parity_kwargs(), {"enable_hierarchical_cache": 1},
                                 where="engine_kwargs.sglang.")


def test_original_logprobs_are_refused_off_temperature_one():
    sr.refuse_original_logprobs(0.7, env={})
    sr.refuse_original_logprobs(1.0, env={sr.ORIGINAL_LOGPROB_ENV: "1"})
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=1 with temperature 0.7"):
        sr.refuse_original_logprobs(0.7, env={sr.ORIGINAL_LOGPROB_ENV: "1"})


def _engine(**args):
    base = dict(enable_fp32_lm_head=True, disable_radix_cache=True, disable_overlap_schedule=True, dtype="bfloat16")
    return SimpleNamespace(server_args=SimpleNamespace(**{**base, **args}))


def test_verify_engine_names_each_setting_not_held(monkeypatch):
    monkeypatch.delenv(sr.ORIGINAL_LOGPROB_ENV, raising=False)
    assert all(sr.verify_engine(_engine(), fp32_lm_head=True).values())
    held = sr.verify_engine(_engine(enable_fp32_lm_head=False, disable_radix_cache=False), fp32_lm_head=True)
    assert held == {"disable_overlap_schedule": True, "logprobs after the temperature": True,
                    "disable_radix_cache": False, "enable_fp32_lm_head": False}
    assert "disable_radix_cache" not in sr.verify_engine(_engine(disable_radix_cache=False), prefix_cache_policy="reset")
    with pytest.raises(spec.EngineParityError, match="disable_radix_cache, enable_fp32_lm_head not held"):
        sr.verify_engine(_engine(enable_fp32_lm_head=False, disable_radix_cache=False), fp32_lm_head=True, strict=True)
    monkeypatch.setenv(sr.ORIGINAL_LOGPROB_ENV, "1")
    assert sr.verify_engine(_engine())["logprobs after the temperature"] is False
    with pytest.raises(TypeError, match="no server_args: pass an sglang.Engine"):
        sr.verify_engine(object())
