"""The NeMo RL adapter beside NeMo RL's own ``ClippedPGLossFn``, at v0.7.0 and at main (7ea279ab).

Both source trees are imported from ``../shared/anchors/nemo-rl`` (support/nemo_anchor.py) and
driven through NeMo RL's own ``BatchedDataDict`` and ``process_global_batch`` plus its worker's
microbatch loop and ``grpo_train``'s metric aggregation (support/nemo_harness.py). For each of
NeMo RL's importance-sampling settings (none, plain IS, tis, tis with a floor, icepop,
seq-mask-tis, a sequence-level loss with dual clip), on a finite batch and on one with NaN, −inf
and +inf engine logprobs on valid tokens, the adapter built from the same ``loss_fn`` block gives
NeMo RL's loss, gradient and every metric key NeMo RL returns.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from integration_tests.shared_batch import all_config_names, config_for, load_expected, make_shared_batch
from integration_tests.support.nemo_anchor import ANCHORS, VERSIONS, skip_unless_available
from integration_tests.support.nemo_harness import (
    GRPO_READS,
    aggregate,
    cpu_cuda,
    finite_or_sentinel,
    global_counts,
    load,
    nemo_data,
    split_step_rescale,
    train_step,
)
from rollout_parity import CorrectionConfig
from rollout_parity.adapters import nemo_rl as nemo_rl_adapter
from rollout_parity.adapters.nemo_rl import (
    NEMO_METRIC_KEYS,
    RolloutParityLossFn,
    check_nemo_rl_vllm_kwargs,
    correction_from_nemo_rl,
    nemo_rl_generation_config,
)

pytestmark = [pytest.mark.nemo_rl]

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOL = dict(rtol=1e-5, atol=1e-6)
APPROX = dict(rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module", params=VERSIONS)
def nemo(request):
    skip_unless_available()
    with ANCHORS.activate(request.param) as ns:
        yield load(ns)


# ----------------------------------------------------------------- batches

def base_batch(kind: str):
    """The shared batch (8 x 12, ragged, one empty row), sample 2 masked by sample_mask.

    ``finite``: the engine's NaN/−inf replaced by ordinary values. ``nonfinite``: NaN, −inf
    and +inf engine logprobs on three valid tokens (NeMo RL's own loss stays finite there;
    its gen-based metrics do not)."""
    b = make_shared_batch()
    rollout = b.rollout_logprobs.clone()
    if kind == "finite":
        rollout = torch.where(torch.isfinite(rollout), rollout, b.old_logprobs - 0.3)
    else:
        rollout[1, 3] = float("inf")
    sample_mask = torch.ones(8)
    sample_mask[2] = 0.0
    return b, rollout, sample_mask


def make_data(ns, kind: str, rollout=None):
    b, default_rollout, sample_mask = base_batch(kind)
    current = b.fresh_current()
    data = nemo_data(ns, b.old_logprobs, default_rollout if rollout is None else rollout, current,
                     b.response_mask, b.advantages, sample_mask=sample_mask)
    return data, current


def agreed_rollout(kind: str):
    """The engine's non-finite logprobs replaced by the trainer's: what the adapter's NeMo RL
    metrics count a non-finite token as."""
    b, rollout, _ = base_batch(kind)
    return torch.where(torch.isfinite(rollout), rollout, b.old_logprobs)


NEMO_CASES = {
    "no_is": dict(),
    "plain_is": dict(use_importance_sampling_correction=True),
    "tis": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=1.2),
    "tis_floor_dual_clip": dict(use_importance_sampling_correction=True,
                                truncated_importance_sampling_type="tis",
                                truncated_importance_sampling_ratio=1.2,
                                truncated_importance_sampling_ratio_min=0.9, ratio_clip_c=3.0),
    "icepop": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                   truncated_importance_sampling_ratio=1.1, truncated_importance_sampling_ratio_min=0.9),
    "seq_mask_tis": dict(use_importance_sampling_correction=True,
                         truncated_importance_sampling_type="seq-mask-tis",
                         truncated_importance_sampling_ratio=1.02,
                         truncated_importance_sampling_ratio_min=0.98),
    "seq_level_icepop_dual_clip": dict(use_importance_sampling_correction=True,
                                       truncated_importance_sampling_type="icepop",
                                       truncated_importance_sampling_ratio=1.1,
                                       truncated_importance_sampling_ratio_min=0.9,
                                       token_level_loss=False, ratio_clip_c=3.0, ratio_clip_max=0.28,
                                       reference_policy_kl_type="k2"),
}
# NeMo RL's metrics that read generation_logprobs without sanitising them (NaN/inf there).
GEN_METRICS = ("token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error",
               "approx_entropy")


def run(ns, loss_fn, kind, rollout=None, mbs=2):
    data, current = make_data(ns, kind, rollout)
    total, mb_metrics = train_step(ns, loss_fn, data, mbs)
    return total, current.grad, aggregate(mb_metrics)


@pytest.mark.parametrize("kind", ["finite", "nonfinite"])
@pytest.mark.parametrize("case", sorted(NEMO_CASES))
def test_side_by_side_with_nemo_clipped_pg_loss(nemo, case, kind):
    cfg = nemo.ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **NEMO_CASES[case])
    theirs_fn = nemo.ClippedPGLossFn(cfg)
    ours_fn = RolloutParityLossFn.from_nemo_config(cfg)
    assert ours_fn.loss_type == theirs_fn.loss_type and ours_fn.input_type == theirs_fn.input_type

    their_loss, their_grad, theirs = run(nemo, theirs_fn, kind)
    our_loss, our_grad, ours = run(nemo, ours_fn, kind)

    assert math.isfinite(their_loss) and torch.isfinite(their_grad).all()
    assert our_loss == pytest.approx(their_loss, **APPROX)
    torch.testing.assert_close(our_grad, their_grad, **TOL)
    assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))
    assert all(key in ours for key in GRPO_READS)
    assert finite_or_sentinel(ours) == []
    reference = theirs
    if kind == "nonfinite":
        # NeMo RL's own gen-based metrics are NaN/inf here; ours count such a token as one
        # where the engine agreed with the trainer: NeMo RL's values on that batch.
        assert any(not math.isfinite(theirs[k]) for k in GEN_METRICS)
        _, _, agreed = run(nemo, nemo.ClippedPGLossFn(cfg), kind, rollout=agreed_rollout(kind))
        reference = {**theirs, **{k: agreed[k] for k in GEN_METRICS}}
        assert ours["rollout_correction/nonfinite_frac"] == pytest.approx(3 / ours["global_valid_toks"])
    for key in reference:
        assert ours[key] == pytest.approx(reference[key], **APPROX), key
    if "truncated_importance_sampling_type" in NEMO_CASES[case]:
        assert 0 < ours["is_oob_ratio"] < 1


@pytest.mark.parametrize("case", ["tis_floor_dual_clip", "seq_level_icepop_dual_clip"])
def test_logits_through_nemo_prepare_loss_input(nemo, case):
    """From logits: NeMo RL's own ``prepare_loss_input`` (``algorithms/loss/utils.py``) turns
    them into next-token logprobs for a LOGPROB loss, as its workers do, and the gradient
    reaches the logits the same way for both losses."""
    prepare = nemo.load("nemo_rl.algorithms.loss.utils").prepare_loss_input
    g = torch.Generator().manual_seed(3)
    B, S, V = 6, 9, 40
    input_ids = torch.randint(0, V, (B, S), generator=g)
    base = torch.randn(B, S, V, generator=g)
    lp = torch.log_softmax(base, -1)[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    prev = torch.cat([torch.zeros(B, 1), lp + 0.05 * torch.randn(B, S - 1, generator=g)], 1)
    gen = torch.cat([torch.zeros(B, 1), lp + 0.2 * torch.randn(B, S - 1, generator=g)], 1)
    token_mask = torch.cat([torch.zeros(B, 1), (torch.arange(S - 1)[None] < torch.tensor(
        [[8], [3], [5], [0], [8], [6]])).float()], 1)
    data = dict(input_ids=input_ids, prev_logprobs=prev, generation_logprobs=gen, token_mask=token_mask,
                advantages=torch.tensor([1.0, -0.5, 0.3, 0.8, -1.2, 0.4])[:, None].expand(B, S).clone(),
                sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0]),
                reference_policy_logprobs=prev)
    cfg = nemo.ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **NEMO_CASES[case])
    results = []
    for loss_fn in (nemo.ClippedPGLossFn(cfg), RolloutParityLossFn.from_nemo_config(cfg)):
        logits = base.clone().requires_grad_(True)
        batch = nemo.BatchedDataDict({k: v.clone() for k, v in data.items()})
        with cpu_cuda():  # it moves the token ids to the GPU
            loss_input, batch = prepare(logits, batch, loss_fn)
        gvs = batch["sample_mask"].sum()
        gvt = (batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum()
        loss, metrics = loss_fn(data=batch, global_valid_seqs=gvs, global_valid_toks=gvt, **loss_input)
        loss.backward()
        results.append((loss.detach(), logits.grad, metrics))
    (theirs, their_grad, their_metrics), (ours, our_grad, our_metrics) = results
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(our_grad, their_grad, **TOL)
    assert bool(their_grad.abs().sum() > 0)
    for key, value in their_metrics.items():
        assert our_metrics[key] == pytest.approx(value, **APPROX), key


def test_plain_is_with_a_minus_inf_engine_logprob_gives_no_huge_weight(nemo):
    """The crash the issue names: plain IS maps to a cap of e^20, so −inf (maximal mismatch
    in the shared rule) weighed ~5e8 and one token turned a loss of +0.06 into −5.5e6."""
    cfg = dict(reference_policy_kl_penalty=0.0, use_importance_sampling_correction=True)
    loss_fn = RolloutParityLossFn.from_nemo_config(cfg)
    data, current = make_data(nemo, "nonfinite")
    batch, gvs, gvt = global_counts(nemo, data, loss_fn)
    loss, _ = loss_fn(current, batch, gvs, gvt)
    assert float(loss_fn.last_correction.weights.max()) < 10.0
    assert abs(float(loss.detach())) < 1.0
    shared = RolloutParityLossFn(loss_fn.correction)  # the shared rule: the cap, by design
    shared(current.detach(), batch, gvs, gvt)
    assert float(shared.last_correction.weights.max()) > 1e8


def test_every_nemo_metric_key_is_returned(nemo):
    assert set(NEMO_METRIC_KEYS) | {"is_oob_ratio"} >= {
        k for case in NEMO_CASES.values()
        for k in run(nemo, nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(
            reference_policy_kl_penalty=0.0, **case)), "finite", mbs=8)[2]
        if k not in ("global_valid_seqs", "global_valid_toks")}


# ----------------------------------------------------------------- the shared cross-framework batch


def shared_data(ns, sample_mask=None):
    b = make_shared_batch()
    current = b.fresh_current()
    return b, nemo_data(ns, b.old_logprobs, b.rollout_logprobs, current, b.response_mask,
                        b.advantages, sample_mask=sample_mask), current


@pytest.mark.parametrize("name", all_config_names())
def test_shared_batch_through_adapter_equals_core(nemo, name):
    """Weights, mask, loss, gradient and the core's metrics of the cross-framework batch."""
    expected = load_expected()[name]
    _, data, current = shared_data(nemo)
    loss_fn = RolloutParityLossFn(config_for(name), metrics="local")
    total, mb_metrics = train_step(nemo, loss_fn, data, microbatch_size=8)
    out = loss_fn.last_correction
    exp = {k: torch.tensor(v) for k, v in expected.items() if k != "metrics"}
    torch.testing.assert_close(out.weights, exp["weights"], rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(out.mask.float(), exp["mask"].float(), rtol=0, atol=0)
    # NeMo RL fixes global_valid_toks before the loss, so tokens removed by rejection still
    # count in the denominator (as NeMo RL's own icepop zeros do); the core's stand-alone
    # token-mean divides by the kept tokens. The two differ by exactly that ratio.
    gvt = float(data["token_mask"][:, 1:].sum())
    scale = max(float(exp["mask"].sum()), 1.0) / gvt
    assert total == pytest.approx(float(exp["loss"]) * scale, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(current.grad, exp["grad"] * scale, rtol=1e-6, atol=1e-7)
    metrics = mb_metrics[0]
    for key, value in expected["metrics"].items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def core_to_nemo(name: str, core: dict, batch) -> dict:
    """The core's whole-batch metrics with NeMo RL's denominators (global valid tokens and
    samples); an empty sample counts as on-policy. Independent of any microbatching."""
    mask = batch.response_mask
    gvt, gvs = float(mask.sum()), float(mask.shape[0])
    n_seq = float((mask.sum(-1) > 0).sum())
    finite = mask * torch.isfinite(batch.rollout_logprobs)
    n_ppl = float((finite.sum(-1) > 0).sum())
    keep = torch.tensor(load_expected()[name]["mask"])
    n_kept = float(keep.sum())
    out = {}
    for key, value in core.items():
        short = key.split("/", 1)[1]
        if key.startswith("policy/"):
            out[key] = value * n_kept / gvt
        elif short in ("chi2_seq", "rejected_seq_frac", "off_policy_masked_frac"):
            out[key] = value * n_seq / gvs
        elif short in ("log_ppl_diff", "log_ppl_abs_diff"):
            out[key] = value * n_ppl / gvs
        elif short == "ppl_ratio":
            out[key] = ((value - 1.0) * n_ppl + gvs) / gvs
        elif short in nemo_rl_adapter._LEFT_OUT:
            continue
        else:
            assert short in nemo_rl_adapter._TOKEN_MEANS, key
            out[key] = value
    return out


def test_every_core_diagnostic_is_summed_or_left_out_by_name():
    """A diagnostic the core adds must be classified here before NeMo RL sums it."""
    from integration_tests.shared_batch import core_reference

    classes = [nemo_rl_adapter._TOKEN_MEANS, nemo_rl_adapter._SEQ_MEANS, nemo_rl_adapter._PPL_MEANS,
               nemo_rl_adapter._LEFT_OUT]
    for key in core_reference("tis_srs_k3")["metrics"]:
        short = key.split("/", 1)[1]
        if key.startswith("policy/"):
            assert key in nemo_rl_adapter._POLICY_MEANS
        else:
            assert sum(short in c for c in classes) == 1, key


@pytest.mark.parametrize("name", ["tis_srs_k3", "icepop", "sequence_mask_token", "k1_k2_rejection",
                                  "off_policy_mask"])
def test_metrics_are_the_global_batch_for_any_microbatching(nemo, name):
    """NeMo RL sums every metric over microbatches: the sums equal the whole batch's metrics
    (sequence metrics included: the issue measured rejected_seq_frac 0.750 vs 0.714 before)."""
    batch = make_shared_batch()
    expected = core_to_nemo(name, load_expected()[name]["metrics"], batch)
    runs = {}
    for mbs in (1, 2, 4, 8):
        _, data, current = shared_data(nemo)
        total, mb_metrics = train_step(nemo, RolloutParityLossFn(config_for(name)), data, mbs)
        runs[mbs] = (total, current.grad, aggregate(mb_metrics))
    total8, grad8, metrics8 = runs[8]
    for key, value in expected.items():
        assert metrics8[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for mbs, (total, grad, metrics) in runs.items():
        assert total == pytest.approx(total8, rel=1e-5, abs=1e-7), mbs
        torch.testing.assert_close(grad, grad8, rtol=1e-5, atol=1e-7)
        for key, value in metrics8.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (mbs, key)
    assert not any(k.endswith(("_max", "_min")) for k in metrics8 if k.startswith("rollout_correction/"))


def test_metric_normalizations_reproduce_the_sync_metrics_in_the_split_step(nemo):
    """Main's Megatron split step calls the loss with placeholder global counts 1 and
    rescales each metric by the denominator ``metric_normalizations`` names."""
    if nemo.MetricNormalizer is None:  # v0.7.0: no split step, nothing to advertise
        assert not hasattr(RolloutParityLossFn(), "metric_normalizations")
        return
    cfg = nemo.ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **NEMO_CASES["seq_mask_tis"])
    for loss_fn in (RolloutParityLossFn.from_nemo_config(cfg),
                    RolloutParityLossFn(config_for("tis_srs_k3"), token_level_loss=False),
                    nemo.ClippedPGLossFn(cfg)):
        data, _ = make_data(nemo, "finite")
        _, sync = train_step(nemo, loss_fn, data, 2)
        data, _ = make_data(nemo, "finite")
        gvs, gvt = float(data["sample_mask"].sum()), float(
            (data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)).sum())
        raw = []
        for mb in data.make_microbatch_iterator(2):
            _, metrics = loss_fn(next_token_logprobs=mb["next_token_logprobs"], data=mb,
                                 global_valid_seqs=torch.tensor(1.0), global_valid_toks=torch.tensor(1.0))
            if metrics["num_valid_samples"] > 0:
                raw.append(dict(metrics))
        split = aggregate(split_step_rescale(nemo, loss_fn, raw, gvs, gvt))
        expected = aggregate(sync)
        assert set(loss_fn.metric_normalizations) >= set(raw[0]) - {"is_oob_ratio"} or \
            isinstance(loss_fn, nemo.ClippedPGLossFn)
        for key, value in split.items():
            assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (type(loss_fn).__name__, key)


# ----------------------------------------------------------------- config and vLLM recipe


def test_yaml_block_loads_through_omegaconf_and_nemo_config(nemo):
    from omegaconf import OmegaConf

    node = OmegaConf.load(CONFIGS / "nemo_rl_loss.yaml")
    # A defaults-style merge onto a base GRPO loss block, as NeMo RL's load_config does.
    base = OmegaConf.create({"loss_fn": {"reference_policy_kl_penalty": 0.01, "ratio_clip_min": 0.2}})
    merged = OmegaConf.merge(base, node)
    cfg = nemo.ClippedPGLossConfig(**OmegaConf.to_container(merged.loss_fn, resolve=True))
    assert cfg.rollout_correction["rollout_rejection"] == ["seq_sum_k3"]  # extra="allow" kept it
    loss_fn = RolloutParityLossFn.from_nemo_config(cfg)
    assert loss_fn.correction == CorrectionConfig.preset("tis_srs_k3")
    assert (loss_fn.ratio_clip_min, loss_fn.ratio_clip_max) == (0.2, 0.28)
    assert loss_fn.nonfinite == "shared"
    assert RolloutParityLossFn.from_nemo_config(merged.loss_fn).correction == loss_fn.correction
    assert OmegaConf.to_container(node.policy) == nemo_rl_generation_config()["policy"]


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
    gen = nemo_rl_generation_config(fp32_lm_head=True)["policy"]
    assert gen["generation"]["vllm_cfg"] == {"enable_prefix_caching": False,
                                             "logprobs_mode": "processed_logprobs"}
    assert gen["generation"]["vllm_kwargs"] == {"async_scheduling": False}
    assert gen["hf_config_overrides"] == {"head_dtype": "float32"}
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
    vllm_cfg = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "expert_parallel_size": 1,
                "gpu_memory_utilization": 0.5, "max_model_len": 256, "skip_tokenizer_init": False,
                "precision": "bfloat16", "load_format": "auto", "enforce_eager": True,
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


def test_recipe_through_nemo_rls_own_engine_assembly(nemo, monkeypatch):
    """v0.7.0 fixes logprobs_mode itself; main passes vllm_cfg.logprobs_mode or nothing (vLLM's
    raw default). The recipe lands as processed logprobs, no prefix caching, no async
    scheduling and the fp32 head on both, and vLLM's own EngineArgs accepts every key."""
    from vllm.engine.arg_utils import EngineArgs

    policy = nemo_rl_generation_config(fp32_lm_head=True)["policy"]
    kwargs = nemo_engine_kwargs(nemo, monkeypatch, policy)
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["enable_prefix_caching"] is False and kwargs["async_scheduling"] is False
    assert kwargs["hf_overrides"] == {"head_dtype": "float32"}
    EngineArgs(**kwargs)
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


def test_bad_configs_and_data(nemo):
    with pytest.raises(ValueError, match="twice"):
        RolloutParityLossFn.from_nemo_config(dict(
            reference_policy_kl_penalty=0.0, use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0,
            rollout_correction={"rollout_importance_sampling_mode": "token_truncate"}))
    with pytest.raises(ValueError, match="use_cispo"):
        RolloutParityLossFn.from_nemo_config(dict(reference_policy_kl_penalty=0.0, use_cispo=True))
    with pytest.raises(ValueError, match="reference_policy_kl_penalty"):
        RolloutParityLossFn.from_nemo_config(dict(reference_policy_kl_penalty=0.01))
    with pytest.raises(ValueError, match="unknown correction flag"):
        RolloutParityLossFn.from_nemo_config(dict(reference_policy_kl_penalty=0.0,
                                                  rollout_correction={"rollout_is_mode": "x"}))
    with pytest.raises(ValueError, match="unknown key"):
        RolloutParityLossFn.from_nemo_config(dict(reference_policy_kl_penalty=0.0, ratio_clip=0.2))
    with pytest.raises(ValueError, match="reference_policy_kl_type"):
        RolloutParityLossFn(reference_policy_kl_type="k4")
    with pytest.raises(ValueError, match="rollout_sampling_replay=True: NeMo RL's generation"):
        RolloutParityLossFn.from_nemo_config(dict(reference_policy_kl_penalty=0.0, rollout_correction={
            "rollout_importance_sampling_mode": "token_truncate", "rollout_sampling_replay": True}))
    data, current = make_data(nemo, "finite")
    loss_fn = RolloutParityLossFn(CorrectionConfig.preset("icepop"))
    with pytest.raises(ValueError, match=r"\[:, 1:\]"):
        loss_fn(torch.cat([current, current[:, :1]], dim=1), data, 7, 50)
    broken = nemo.BatchedDataDict(dict(data))
    del broken["generation_logprobs"]
    with pytest.raises(KeyError, match="generation_logprobs"):
        loss_fn(current, broken, 7, 50)


def test_missing_nemo_rl_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_rl.algorithms.loss.interfaces", None)
    with pytest.raises(ImportError, match=r"rollout-parity\[nemo-rl\]"):
        RolloutParityLossFn()
