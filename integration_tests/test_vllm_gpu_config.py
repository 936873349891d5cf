"""Every vLLM engine the package asks for, through vLLM 0.31's own validation as a GPU user's vLLM runs it.

The CPU engines of the other tests cannot start Model Runner V2, so a kwarg only a GPU engine validates
(``enable_return_routed_experts``, ``return_sampling_mask``) never met vLLM's checks there.
``support/vllm_config_check.py`` runs ``vllm.LLM(**kwargs)`` / ``vllm serve`` up to the engine config and
each request through the engine's admission, on vLLM's CUDA platform class (an H100's answers) with Triton,
so Model Runner V2 is what vLLM picks by default, as on a GPU. The kwargs are the adapters' exact ones, from
the functions the adapters build them with (the recipe; TRL's colocated engine with TRL's own kwargs,
captured from a real ``ParityGRPOTrainer``; ``trl vllm-serve`` through TRL's own ``build_command``; verl's
rollout server through its own ``launch_server``; NeMo RL's worker in ``test_nemo_rl_config.py``; the check's
probe and the doctor's engines), for every combination of the flags that reach vLLM. Issue 31, items 1 and 2:
``moe_routing_replay`` built TRL's engine with routed experts and no prefix cache (vLLM: "AuxOutput Connector
requires prefix caching"), and the sync check's probe asked an engine with sampling masks for ``top_k=0``
(vLLM: "sampling distribution replay requires top_k > 0").
"""

from __future__ import annotations

import itertools

import pytest

from rollout_parity.testing.stack import need

need("vllm", extra="vllm-cpu")

from rollout_parity.engines.vllm.features import installed_vllm_version, parse_vllm_version  # noqa: E402

# What these tests pin is vLLM 0.31's GPU behaviour (Model Runner V2 by default, the AuxOutput connector, sampling
# masks). The GPU validation of the recipe on earlier releases runs in test_nemo_rl_config.py (NeMo RL's engines
# on 0.20-0.25, through the same checker).
if parse_vllm_version(installed_vllm_version()) < (0, 31, 0):
    pytest.skip(f"vLLM {installed_vllm_version()}: this module pins vLLM >= 0.31's GPU defaults; earlier releases' "
                "GPU validation of the recipe runs in test_nemo_rl_config.py", allow_module_level=True)

from integration_tests.support.vllm_config_check import assert_accepted, check_engine, check_serve  # noqa: E402
from rollout_parity.core.config import CorrectionConfig  # noqa: E402
from rollout_parity.core.sync_check import make_probe  # noqa: E402
from rollout_parity.engines.vllm.probe import engine_probe_params  # noqa: E402
from rollout_parity.engines.vllm.recipe import PREFIX_CACHE_POLICIES, vllm_parity_kwargs, vllm_serve_flags  # noqa: E402
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402
from rollout_parity.testing.tiny_moe import build_tiny_moe_model  # noqa: E402

pytestmark = [pytest.mark.vllm]

ROUTED_NEEDS_CACHE = "AuxOutput Connector requires prefix caching"
MASK_NEEDS_TOP_K = "sampling distribution replay requires top_k > 0"


@pytest.fixture(scope="module")
def moe() -> str:
    return build_tiny_moe_model()


@pytest.fixture(scope="module")
def dense() -> str:
    return build_tiny_model()


def _model_config(kwargs: dict):
    """vLLM's own ``ModelConfig`` for these kwargs (what the engine's ``model_config`` resolves to)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**kwargs).create_model_config()


def _held(resolved: dict, kwargs: dict) -> None:
    """The engine config holds what the recipe asked for."""
    assert resolved["logprobs_mode"] == "processed_logprobs" and resolved["async_scheduling"] is False
    assert resolved["enable_prefix_caching"] is kwargs["enable_prefix_caching"]
    assert resolved["head_dtype"] == ("float32" if "hf_overrides" in kwargs else resolved["dtype"])
    assert resolved["return_sampling_mask"] is bool(kwargs.get("return_sampling_mask"))
    assert resolved["enable_return_routed_experts"] is bool(kwargs.get("enable_return_routed_experts"))


# ----------------------------------------------------------------------------- the checker


def test_the_checker_is_vllm_on_a_gpu(dense, moe):
    """What a GPU user's vLLM 0.31 resolves by default (CUDA device, Model Runner V2, compiled with CUDA
    graphs, async scheduling on), and vLLM's own refusals, unchanged: no platform default hides them."""
    plain = check_engine(dict(model=dense))
    assert_accepted(plain)
    assert plain.resolved["platform"] == "GpuUserPlatform" and plain.resolved["device"] == "cuda"
    assert plain.resolved["use_v2_model_runner"] and plain.resolved["async_scheduling"]
    assert plain.resolved["compilation_mode"] == 3 and plain.resolved["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert check_engine(dict(model=dense, enforce_eager=True)).resolved["cudagraph_mode"] == "NONE"
    routed_dense = check_engine(dict(model=dense, enable_return_routed_experts=True))
    assert not routed_dense.ok and "only supports MoE models" in routed_dense.error
    routed_uncached = check_engine(dict(model=moe, enable_return_routed_experts=True, enable_prefix_caching=False))
    assert not routed_uncached.ok and ROUTED_NEEDS_CACHE in routed_uncached.error
    masks = check_engine(dict(model=dense, return_sampling_mask=True, logprobs_mode="processed_logprobs"),
                         requests=[dict(temperature=1.0), dict(temperature=1.0, top_k=50)])
    assert masks.ok and MASK_NEEDS_TOP_K in masks.requests[0] and masks.requests[1] is None
    raw_masks = check_engine(dict(model=dense, return_sampling_mask=True))
    assert not raw_masks.ok and "logprobs_mode='processed_logprobs'" in raw_masks.error


# ----------------------------------------------------------------------------- the recipe

RECIPE = list(itertools.product((False, True), PREFIX_CACHE_POLICIES, (False, True), (False, True)))


@pytest.mark.parametrize("fp32_lm_head, policy, sampling_replay, routed", RECIPE,
                         ids=[f"fp32={a}-{b}-replay={c}-routed={d}" for a, b, c, d in RECIPE])
def test_every_recipe_combination_is_built_or_refused_as_vllm_would(moe, fp32_lm_head, policy, sampling_replay,
                                                                     routed):
    options = dict(fp32_lm_head=fp32_lm_head, prefix_cache_policy=policy, sampling_replay=sampling_replay)
    if routed and policy == "off":
        with pytest.raises(ValueError, match="prefix_cache_policy='off'.*'reset'.*'salt'"):
            vllm_parity_kwargs(**options, routed_experts=True)
        naive = dict(vllm_parity_kwargs(**options), enable_return_routed_experts=True)  # what we refuse, to vLLM
        verdict = check_engine(dict(model=moe, **naive))
        assert not verdict.ok and ROUTED_NEEDS_CACHE in verdict.error
        return
    kwargs = dict(model=moe, **vllm_parity_kwargs(**options, routed_experts=routed))
    verdict = check_engine(kwargs)
    assert_accepted(verdict)
    _held(verdict.resolved, kwargs)
    assert verdict.resolved["use_v2_model_runner"]  # vLLM 0.31's default on a GPU; replay and routes need it


@pytest.mark.parametrize("fp32_lm_head, policy", list(itertools.product((False, True), PREFIX_CACHE_POLICIES)))
def test_serve_flags_of_the_recipe_are_a_server_vllm_builds(dense, fp32_lm_head, policy):
    flags = vllm_serve_flags(fp32_lm_head, policy)
    verdict = check_serve(["serve", dense, *flags])
    assert_accepted(verdict)
    _held(verdict.resolved, vllm_parity_kwargs(fp32_lm_head, policy))


@pytest.mark.trl
@pytest.mark.parametrize("fp32_lm_head, policy", [(False, "off"), (True, "off"), (True, "reset")])
def test_trl_vllm_serve_command_through_trls_own_command_builder(dense, fp32_lm_head, policy):
    """``server_command`` -> TRL's ``vllm-serve`` parser and ``build_command`` -> vLLM's ``serve``."""
    need("trl", extra="trl")
    from integration_tests.support.trl_server import trl_vllm_serve_command

    command = trl_vllm_serve_command(dense, fp32_lm_head=fp32_lm_head, prefix_cache_policy=policy)
    verdict = check_serve(command[command.index("serve"):])
    assert_accepted(verdict)
    _held(verdict.resolved, vllm_parity_kwargs(fp32_lm_head, policy))


# ----------------------------------------------------------------------------- TRL's colocated engine

FLAGS = list(itertools.product((False, True), (False, True), (False, True), (None, 1)))


@pytest.fixture(scope="module")
def trl_engine(moe, tmp_path_factory):
    """TRL's own ``vllm.LLM`` kwargs, and the kwargs a real ``ParityGRPOTrainer`` with routing replay, sampling
    replay and the fp32 head hands to ``vllm.LLM`` (recorded; no engine is built)."""
    need("trl", extra="trl")
    from integration_tests.support.trl_runs import captured_engine_kwargs

    tmp = tmp_path_factory.mktemp("trl-engine")
    own = captured_engine_kwargs(tmp / "plain", moe, parity=False)
    flags = dict(rollout_importance_sampling_mode="token_truncate", fp32_lm_head=True, moe_routing_replay=True,
                 rollout_sampling_replay=True, weight_sync_check_interval=1)
    parity = captured_engine_kwargs(tmp / "parity", moe, top_k=50, **flags)
    return own, parity, CorrectionConfig(**flags)


@pytest.mark.trl
def test_a_real_trl_trainer_builds_its_engine_with_colocated_engine_kwargs(trl_engine):
    from rollout_parity.adapters.trl.engine import colocated_engine_kwargs, engine_options

    own, parity, cfg = trl_engine
    assert own["distributed_executor_backend"] == "external_launcher" and own["logprobs_mode"] == "processed_logprobs"
    assert parity == colocated_engine_kwargs(own, **engine_options(cfg))
    assert parity["enable_return_routed_experts"] and parity["enable_prefix_caching"] and parity["return_sampling_mask"]
    verdict = check_engine(parity)
    assert_accepted(verdict)


@pytest.mark.trl
@pytest.mark.parametrize("fp32_lm_head, sampling_replay, routing_replay, check", FLAGS,
                         ids=[f"fp32={a}-sampling={b}-routing={c}-check={d}" for a, b, c, d in FLAGS])
def test_trl_colocated_engine_and_its_requests_for_every_flag_combination(moe, trl_engine, fp32_lm_head,
                                                                          sampling_replay, routing_replay, check):
    """The engine ``ParityGRPOTrainer`` builds for the flags, TRL's generation request (top-k 50 when sampling
    replay is on: the adapter refuses it without a top-k) and the sync check's probe: all accepted by vLLM."""
    from rollout_parity.adapters.trl.engine import colocated_engine_kwargs, engine_options

    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate", fp32_lm_head=fp32_lm_head,
                           rollout_sampling_replay=sampling_replay, moe_routing_replay=routing_replay,
                           weight_sync_check_interval=check)
    kwargs = colocated_engine_kwargs(trl_engine[0], **engine_options(cfg))
    requests = [dict(n=1, temperature=1.0, top_p=1.0, top_k=50 if sampling_replay else 0, max_tokens=12, logprobs=0)]
    if check:
        model_config = _model_config(kwargs)
        requests.append(engine_probe_params(model_config, make_probe(model_config.get_vocab_size()), 1.0))
        assert ("top_k" in requests[-1]) is sampling_replay
    verdict = check_engine(kwargs, requests=requests)
    assert_accepted(verdict)
    _held(verdict.resolved, kwargs)
    assert verdict.resolved["enable_prefix_caching"] is routing_replay  # routes need the cache (policy reset)


def test_the_probe_without_a_top_k_is_what_an_engine_with_sampling_masks_refuses(dense):
    """The request the sync check sent before (no top_k) against the engine ``rollout_sampling_replay`` builds."""
    kwargs = dict(model=dense, **vllm_parity_kwargs(sampling_replay=True))
    probe = make_probe(512)
    plain = engine_probe_params(_model_config(dict(model=dense, **vllm_parity_kwargs())), probe, 1.0)
    verdict = check_engine(kwargs, requests=[plain, engine_probe_params(_model_config(kwargs), probe, 1.0)])
    assert verdict.ok and MASK_NEEDS_TOP_K in verdict.requests[0] and verdict.requests[1] is None


# ----------------------------------------------------------------------------- verl and the package's own engines


@pytest.mark.verl
@pytest.mark.parametrize("fp32_lm_head", [False, True])
def test_verl_rollout_server_arguments_through_verls_own_launch_server(moe, fp32_lm_head):
    """verl's ``launch_server`` merges the adapter's ``engine_kwargs.vllm`` with its own fields into ``vllm
    serve`` flags; vLLM on a GPU builds that server with the recipe."""
    need("verl", extra="verl")
    from integration_tests.support.verl_configs import compose_verl
    from integration_tests.support.verl_vllm_server import verl_serve_argv
    from rollout_parity.adapters import verl as adapter

    config = compose_verl("+rollout_parity.rollout_importance_sampling_mode=token_truncate",
                          f"+rollout_parity.fp32_lm_head={str(fp32_lm_head).lower()}",
                          f"actor_rollout_ref.model.path={moe}", "actor_rollout_ref.rollout.max_model_len=256",
                          "actor_rollout_ref.rollout.prompt_length=64", "actor_rollout_ref.rollout.response_length=64")
    try:
        adapter.configure_verl(config)
        argv = verl_serve_argv(config)
    finally:
        adapter.set_active_config(None)
    verdict = check_serve(argv)
    assert_accepted(verdict)
    _held(verdict.resolved, vllm_parity_kwargs(fp32_lm_head))


def test_the_check_probe_and_the_doctor_build_the_engine_users_run_on_a_gpu(dense, monkeypatch):
    """On a GPU build the probe's engine is compiled with CUDA graphs (no forced eager); on vllm-cpu it stays
    eager, as the CPU suite measured it."""
    import rollout_parity.grpo_rounds as grpo_rounds
    from rollout_parity.check.vllm_probe import probe_engine_kwargs

    cpu = probe_engine_kwargs(dense, 0.3, 100)
    assert cpu["enforce_eager"] is True and cpu["max_model_len"] == 128
    monkeypatch.setattr(grpo_rounds, "is_vllm_cpu_build", lambda: False)  # a CUDA wheel
    gpu = probe_engine_kwargs(dense, 0.3, 100)
    assert "enforce_eager" not in gpu
    verdict = check_engine(gpu)
    assert_accepted(verdict)
    _held(verdict.resolved, gpu)
    assert not verdict.resolved["enforce_eager"] and verdict.resolved["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert verdict.resolved["head_dtype"] == "float32"


def test_every_doctor_engine_is_one_vllm_builds_on_a_gpu(dense, monkeypatch):
    """The doctor's engines (each row's engine kwargs and the shared sizing), on a GPU build: accepted, compiled."""
    import rollout_parity.grpo_rounds as grpo_rounds
    from rollout_parity.doctor.measure import engine_sizing
    from rollout_parity.doctor.rows import CONFIGS, DoctorOptions, engine_kwargs

    assert engine_sizing(DoctorOptions(), 256)["enforce_eager"] is True  # vllm-cpu
    monkeypatch.setattr(grpo_rounds, "is_vllm_cpu_build", lambda: False)
    for key in dict.fromkeys(engine for engine, _, _ in CONFIGS.values()):
        kwargs = dict(model=dense, **engine_kwargs(key), **engine_sizing(DoctorOptions(), 256))
        verdict = check_engine(kwargs)
        assert_accepted(verdict)
        assert verdict.resolved["cudagraph_mode"] == "FULL_AND_PIECEWISE", key
        if key.startswith("recipe"):
            _held(verdict.resolved, kwargs)
