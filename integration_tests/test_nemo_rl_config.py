"""The NeMo RL adapter's configuration rooms: the ``loss_fn`` block (our keys apart from NeMo
RL's, NeMo RL's IS keys in shared flags) and the vLLM parity recipe where NeMo RL reads it,
checked through NeMo RL's own pydantic config and its own vLLM worker's engine-kwargs assembly
(``BaseVllmGenerationWorker._load_model``) at v0.7.0 and main, from ``../shared/anchors``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from integration_tests.support.nemo_anchor import ANCHORS, VERSIONS, skip_unless_available
from integration_tests.support.nemo_harness import load
from rollout_parity import CorrectionConfig
from rollout_parity.adapters.nemo_rl import (
    RolloutParityLossFn,
    check_nemo_rl_vllm_kwargs,
    correction_from_nemo_rl,
    nemo_rl_generation_config,
    split_loss_config,
)

pytestmark = [pytest.mark.nemo_rl]

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module", params=VERSIONS)
def nemo(request):
    skip_unless_available()
    with ANCHORS.activate(request.param) as ns:
        try:
            loaded = load(ns)
        except AssertionError as exc:
            # NeMo RL refuses a newer transformers than its stack pins when its policy package is imported
            # (nemo_rl/models/policy/__init__.py): such a stack (the vLLM matrix's 0.28 and 0.32 venvs) is not
            # one NeMo RL runs on.
            if "transformers" not in str(exc):
                raise
            pytest.skip(f"NeMo RL {request.param} refuses this stack at import: {exc}")
        yield loaded


def test_yaml_block_loads_through_omegaconf_and_nemo_config(nemo):
    """The shipped block merged onto a recipe's loss_fn: NeMo RL's pydantic config keeps our keys
    (``extra="allow"``), the guard resolves only with the resolver, and the recipe's own NeMo RL
    keys (KL, clipping) reach NeMo RL's loss unchanged."""
    from omegaconf import OmegaConf
    from omegaconf.errors import UnsupportedInterpolationType

    node = OmegaConf.load(CONFIGS / "nemo_rl_loss.yaml")
    base = OmegaConf.create({"loss_fn": {"reference_policy_kl_penalty": 0.02, "ratio_clip_max": 0.28}})
    merged = OmegaConf.merge(base, node)
    with pytest.raises(UnsupportedInterpolationType, match="rollout_parity"):
        OmegaConf.to_container(merged.loss_fn, resolve=True)
    OmegaConf.register_new_resolver("rollout_parity", lambda: "resolved")
    try:
        cfg = nemo.ClippedPGLossConfig(**OmegaConf.to_container(merged.loss_fn, resolve=True))
        loss_fn = RolloutParityLossFn.from_nemo_config(cfg)
        assert RolloutParityLossFn.from_nemo_config(merged.loss_fn).correction == loss_fn.correction
    finally:
        OmegaConf.clear_resolver("rollout_parity")
    assert cfg.rollout_correction["rollout_rejection"] == ["seq_sum_k3"] and cfg.rollout_parity == "resolved"
    assert loss_fn.correction == CorrectionConfig.preset("tis_srs_k3")
    assert (loss_fn.reference_policy_kl_penalty, loss_fn.ratio_clip_max) == (0.02, 0.28)
    assert OmegaConf.to_container(node.policy) == nemo_rl_generation_config()["policy"]


def test_split_keeps_nemos_keys_and_takes_ours():
    flags, nemo_keys = split_loss_config({"ratio_clip_max": 0.28, "rollout_parity": "rollout-parity 0.1.0",
                                          "rollout_correction": {"rollout_importance_sampling_mode": "token_mask"}})
    assert flags == CorrectionConfig(rollout_importance_sampling_mode="token_mask")
    assert nemo_keys == {"ratio_clip_max": 0.28}
    assert split_loss_config({"ratio_clip_max": 0.2}) == (CorrectionConfig(), {"ratio_clip_max": 0.2})


def test_mapping_table():
    assert correction_from_nemo_rl({}) == CorrectionConfig()
    tis = correction_from_nemo_rl(dict(use_importance_sampling_correction=True,
                                       truncated_importance_sampling_type="tis",
                                       truncated_importance_sampling_ratio=2.0))
    assert tis == CorrectionConfig(rollout_importance_sampling_mode="token_truncate",
                                   rollout_importance_sampling_threshold=2.0)
    icepop = correction_from_nemo_rl(dict(use_importance_sampling_correction=True,
                                          truncated_importance_sampling_type="icepop",
                                          truncated_importance_sampling_ratio=2.0,
                                          truncated_importance_sampling_ratio_min=0.5))
    assert icepop == CorrectionConfig.preset("icepop")
    seq = correction_from_nemo_rl(dict(use_importance_sampling_correction=True,
                                       truncated_importance_sampling_type="seq-mask-tis",
                                       truncated_importance_sampling_ratio=1.002,
                                       truncated_importance_sampling_ratio_min=0.999))
    assert seq.rollout_importance_sampling_mode == "sequence_mask"
    assert seq.rollout_importance_sampling_sequence_reduction == "geometric_mean"
    assert seq.rollout_importance_sampling_sequence_mask_weight == "token"
    bad = [
        (dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0),
         "use_importance_sampling_correction"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
              truncated_importance_sampling_ratio=2.0), "ratio_min"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="gspo",
              truncated_importance_sampling_ratio=2.0), "truncated_importance_sampling_type"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
              truncated_importance_sampling_ratio=None), "truncated_importance_sampling_ratio"),
    ]
    for cfg, match in bad:
        with pytest.raises(ValueError, match=match):
            correction_from_nemo_rl(cfg)


def test_recipe_routing():
    gen = nemo_rl_generation_config()["policy"]
    assert gen["generation"]["vllm_cfg"] == {"enable_prefix_caching": False,
                                             "logprobs_mode": "processed_logprobs"}
    assert gen["generation"]["vllm_kwargs"] == {"async_scheduling": False}
    assert "hf_config_overrides" not in gen
    with pytest.raises(ValueError, match="fp32_lm_head=True cannot be served on NeMo RL"):
        nemo_rl_generation_config(fp32_lm_head=True)
    with pytest.raises(ValueError, match="vllm_cfg"):
        check_nemo_rl_vllm_kwargs({"logprobs_mode": "processed_logprobs"})


def nemo_engine_kwargs(nemo, monkeypatch, policy: dict) -> dict:
    """The ``vllm.LLM(**kwargs)`` NeMo RL's own ``BaseVllmGenerationWorker._load_model`` builds
    from ``policy.generation`` (the engine itself is not started: ``_create_engine`` records)."""
    from rollout_parity.testing.tiny_model import build_tiny_model

    worker_mod = nemo.load("nemo_rl.models.generation.vllm.vllm_worker")
    monkeypatch.setattr(worker_mod, "log_gpu_memory_diagnostics", lambda *a, **k: None)  # NVML
    for var in ("VLLM_USE_V1", "VLLM_ALLOW_INSECURE_SERIALIZATION"):  # _load_model sets them
        monkeypatch.delenv(var, raising=False)
    model = build_tiny_model()
    generation = policy["generation"]
    # NeMo RL's own example (examples/configs/grpo_math_1B.yaml: CUDA graphs, enforce_eager False), but the
    # tiny model's length; the recipe's vllm_cfg on top
    vllm_cfg = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "expert_parallel_size": 1,
                "gpu_memory_utilization": 0.6, "max_model_len": 256, "skip_tokenizer_init": False,
                "precision": "bfloat16", "load_format": "auto", "enforce_eager": False,
                "async_engine": False, "kv_cache_dtype": "auto", **generation.get("vllm_cfg", {})}
    vllm_kwargs = dict(generation.get("vllm_kwargs", {}))
    vllm_kwargs["hf_overrides"] = policy.get("hf_config_overrides", {})  # grpo.py's setup does this
    worker = worker_mod.BaseVllmGenerationWorker.__new__(worker_mod.BaseVllmGenerationWorker)
    worker.cfg = {"model_name": model, "vllm_cfg": vllm_cfg, "vllm_kwargs": vllm_kwargs}
    worker.model_name, worker.precision, worker.fraction_of_gpus = model, "bfloat16", 1.0
    worker.tensor_parallel_size = worker.pipeline_parallel_size = worker.expert_parallel_size = 1
    worker.enable_expert_parallel, worker.gpu_memory_utilization = False, 0.5
    captured: dict = {}
    worker._create_engine = captured.update
    worker_mod.BaseVllmGenerationWorker._load_model(worker, None, 0)
    return captured


@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["off", "reset", "salt"])
def test_nemo_rls_engine_with_the_recipe_is_one_vllm_builds_on_a_gpu(nemo, monkeypatch, policy):
    """The exact ``vllm.LLM`` kwargs NeMo RL's worker assembles from ``nemo_rl_generation_config``, through
    vLLM 0.31's own config validation on a GPU user's platform (``support/vllm_config_check.py``). The fp32
    head is refused on NeMo RL before any config is built (its trainer's head stays in policy.precision)."""
    from integration_tests.support.vllm_config_check import assert_accepted, check_engine

    with pytest.raises(ValueError, match="fp32_lm_head=True cannot be served on NeMo RL"):
        nemo_rl_generation_config(fp32_lm_head=True, prefix_cache_policy=policy)
    policy_cfg = nemo_rl_generation_config(prefix_cache_policy=policy)["policy"]
    kwargs = nemo_engine_kwargs(nemo, monkeypatch, policy_cfg)
    verdict = check_engine(kwargs)
    assert_accepted(verdict)
    resolved = verdict.resolved
    assert resolved["logprobs_mode"] == "processed_logprobs" and resolved["async_scheduling"] is False
    assert resolved["enable_prefix_caching"] is (policy != "off")
    assert resolved["head_dtype"] == resolved["dtype"]
    assert not resolved["enforce_eager"] and resolved["cudagraph_mode"] != "NONE"  # the compiled engine users run


def test_recipe_through_nemo_rls_own_engine_assembly(nemo, monkeypatch):
    """v0.7.0 fixes logprobs_mode itself; main passes vllm_cfg.logprobs_mode or nothing (vLLM's
    raw default). The recipe lands as processed logprobs, no prefix caching and no async
    scheduling on both, and vLLM's own EngineArgs accepts every key. ``policy.hf_config_overrides``
    reaches vLLM's ``hf_overrides`` (the channel an fp32 vLLM head would take; the recipe refuses
    fp32_lm_head on NeMo RL because the trainer's head cannot follow)."""
    from vllm.engine.arg_utils import EngineArgs

    policy = nemo_rl_generation_config()["policy"]
    kwargs = nemo_engine_kwargs(nemo, monkeypatch, policy)
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["enable_prefix_caching"] is False and kwargs["async_scheduling"] is False
    assert kwargs["hf_overrides"] == {}
    EngineArgs(**kwargs)
    by_hand = nemo_engine_kwargs(nemo, monkeypatch, {**policy, "hf_config_overrides": {"head_dtype": "float32"}})
    assert by_hand["hf_overrides"] == {"head_dtype": "float32"}
    EngineArgs(**by_hand)
    # Without vllm_cfg.logprobs_mode main leaves vLLM's default, raw logprobs; v0.7.0 does not.
    without = {"generation": {"vllm_cfg": {"enable_prefix_caching": False},
                              "vllm_kwargs": {"async_scheduling": False}}}
    old_recipe = nemo_engine_kwargs(nemo, monkeypatch, without)
    if nemo.MetricNormalizer is None:  # v0.7.0
        assert old_recipe["logprobs_mode"] == "processed_logprobs"
        # The recipe's keys put naively into vllm_kwargs collide with NeMo RL's own.
        naive = {"generation": {"vllm_cfg": {"enable_prefix_caching": False},
                                "vllm_kwargs": {"logprobs_mode": "processed_logprobs"}}}
        with pytest.raises(TypeError, match="multiple values"):
            nemo_engine_kwargs(nemo, monkeypatch, naive)
    else:
        assert "logprobs_mode" not in old_recipe


