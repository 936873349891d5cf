"""compute_correction and policy_loss against the naive per-token reference.

Every expected number comes from ``naive_reference`` (fed the raw flags, never the
package's parsing) or from a formula written in the test, never from the output under test.
Batches are seeded from the flags with ``zlib.crc32`` (stable across processes, unlike
``hash``), so a failure reproduces.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from rollout_parity import CorrectionConfig, compute_correction, policy_loss

from .naive_reference import naive_correction, naive_everything, naive_metrics, naive_ppo

MODES = [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def make_batch(seed=0, B=6, T=9, spread=0.3, with_bad=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 2 - 0.05
    rollout = old + torch.randn(B, T, generator=g) * spread
    current = old + torch.randn(B, T, generator=g) * 0.1
    adv = torch.randn(B, generator=g)
    if with_bad:
        rollout[0, 1] = float("nan")
        rollout[0, 3] = float("-inf")
        old[0, 5] = float("-inf")
    return old, rollout, current, mask, adv


def as_lists(*tensors):
    return [t.tolist() for t in tensors]


def seed_of(flags) -> int:
    """A seed that is the same in every process (``hash(str)`` is salted per process)."""
    return zlib.crc32(repr(sorted(flags.items())).encode()) % 1000


def assert_metrics_match(got, want, rel=2e-5, abs_=2e-6):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rel, abs=abs_), key


CONFIGS = []
for mode, lower, reduction, seq_w in itertools.product(
        MODES, [None, 0.8], ["geometric_mean", "product"], ["token", "sequence"]):
    if mode is None and (lower is not None or seq_w == "sequence"):
        continue
    CONFIGS.append(dict(rollout_importance_sampling_mode=mode, rollout_importance_sampling_threshold=1.3,
                        rollout_importance_sampling_threshold_lower=lower,
                        rollout_importance_sampling_sequence_reduction=reduction,
                        rollout_importance_sampling_sequence_mask_weight=seq_w))
REJECTIONS = [
    dict(rollout_rejection=["token_k1"], rollout_rejection_threshold=1.3),
    dict(rollout_rejection=["token_k2", "token_k3"], rollout_rejection_threshold=[0.05, 0.04]),
    dict(rollout_rejection=["seq_sum_k1"], rollout_rejection_threshold="0.7_1.5"),
    dict(rollout_rejection=["seq_sum_k2", "seq_sum_k3"], rollout_rejection_threshold=0.1),
    dict(rollout_rejection=["seq_mean_k1", "seq_mean_k3"], rollout_rejection_threshold=[[0.9, 1.2], 0.02]),
    dict(rollout_rejection=["seq_mean_k2"], rollout_rejection_threshold=0.02),
    dict(rollout_rejection=["seq_max_k2", "seq_max_k3"], rollout_rejection_threshold=[0.1, 0.2]),
    dict(rollout_importance_sampling_mode="token_truncate", rollout_rejection=["seq_sum_k3"],
         rollout_rejection_threshold=0.3),
    # rejection and the off-policy mask together: a sequence only the off-policy mask drops is not "rejected"
    dict(rollout_rejection=["seq_sum_k3", "token_k2"], rollout_rejection_threshold=[0.3, 0.08],
         off_policy_sequence_mask_delta=0.02),  # here row 5 is masked by the off-policy mask alone
]


@pytest.mark.parametrize("flags", CONFIGS + REJECTIONS)
@pytest.mark.parametrize("with_bad", [False, True])
def test_weights_mask_and_metrics_match_naive(flags, with_bad):
    cfg = CorrectionConfig(**flags)
    old, rollout, current, mask, adv = make_batch(seed=seed_of(flags), with_bad=with_bad)
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current, with_metrics=True)
    lists = as_lists(old, rollout, mask)
    ref = naive_correction(flags, *lists, adv.tolist(), current.tolist())
    torch.testing.assert_close(out.weights, torch.tensor(ref.weights), rtol=1e-5, atol=1e-6)
    assert out.mask.tolist() == [[float(k) for k in row] for row in ref.keep]
    assert not out.weights.requires_grad
    assert_metrics_match(out.metrics, naive_metrics(flags, *lists, ref, adv.tolist(), current.tolist()))


@pytest.mark.parametrize("delta", [0.01, 0.05])
@pytest.mark.parametrize("with_bad", [False, True])
def test_off_policy_sequence_mask_matches_naive(delta, with_bad):
    flags = dict(off_policy_sequence_mask_delta=delta)
    old, rollout, current, mask, adv = make_batch(seed=3, spread=0.1, with_bad=with_bad)
    out = compute_correction(CorrectionConfig(**flags), old_logprobs=old, rollout_logprobs=rollout,
                             response_mask=mask, advantages=adv, current_logprobs=current)
    ref = naive_correction(flags, *as_lists(old, rollout, mask), adv.tolist(), current.tolist())
    assert out.mask.tolist() == [[float(k) for k in row] for row in ref.keep]
    assert out.off_policy_masked.tolist() == ref.off_policy
    assert any(ref.off_policy), "the batch must make the mask act"
    # It only ever masks negative-advantage sequences.
    masked_seqs = out.off_policy_masked.nonzero().flatten().tolist()
    assert all(adv[i] < 0 for i in masked_seqs)


def test_off_policy_mask_falls_back_to_old_without_rollout():
    cfg = CorrectionConfig(off_policy_sequence_mask_delta=0.01)
    old, _, current, mask, _ = make_batch(seed=4)
    adv = -torch.ones(old.shape[0])
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=None, response_mask=mask,
                             advantages=adv, current_logprobs=current)
    drift = ((old - current) * mask).sum(-1) / mask.sum(-1)
    assert out.off_policy_masked.tolist() == (drift > 0.01).tolist()


def test_token_advantages_are_averaged_per_sequence():
    cfg = CorrectionConfig(off_policy_sequence_mask_delta=0.01)
    old, rollout, current, mask, adv = make_batch(seed=5)
    out_seq = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                                 advantages=adv, current_logprobs=current)
    out_tok = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                                 advantages=adv[:, None].expand_as(old).clone(), current_logprobs=current)
    assert torch.equal(out_seq.mask, out_tok.mask)


def test_token_level_advantages_match_naive():
    """(B, T) advantages: per-sequence mean for the off-policy mask, per-token sign for C(r)."""
    flags = dict(rollout_importance_sampling_mode="token_truncate", off_policy_sequence_mask_delta=0.005)
    old, rollout, current, mask, _ = make_batch(seed=14, spread=0.1, with_bad=True)
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(2))
    current = current.requires_grad_()
    out = compute_correction(CorrectionConfig(**flags), old_logprobs=old, rollout_logprobs=rollout,
                             response_mask=mask, advantages=adv, current_logprobs=current)
    loss, metrics = policy_loss(CorrectionConfig(**flags), current_logprobs=current, old_logprobs=old,
                                advantages=adv, correction=out)
    loss.backward()
    ref = naive_everything(flags, *as_lists(old, rollout, mask), adv.tolist(), current.tolist())
    assert any(ref["correction"].off_policy)
    assert out.mask.tolist() == [[float(k) for k in row] for row in ref["keep"]]
    assert loss.item() == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(current.grad, torch.tensor(ref["grad"]), rtol=1e-5, atol=1e-7)
    assert_metrics_match(metrics, ref["metrics"])


@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("reduction", ["geometric_mean", "product"])
def test_metrics_without_advantages_match_naive(mode, reduction):
    flags = dict(rollout_importance_sampling_mode=mode, rollout_importance_sampling_threshold=1.2,
                 rollout_importance_sampling_sequence_reduction=reduction)
    old, rollout, current, mask, adv = make_batch(seed=11, spread=0.2)
    out = compute_correction(CorrectionConfig(**flags), old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    lists = as_lists(old, rollout, mask)
    ref = naive_metrics(flags, *lists, naive_correction(flags, *lists))
    assert_metrics_match(out.metrics, ref)
    assert ref["rollout_correction/loss_contrib_pos"] == 0.0  # no advantages, no C(r)


def test_fraction_metrics_count_what_they_say():
    flags = dict(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=1.1,
                 rollout_rejection=["token_k2"], rollout_rejection_threshold=0.02)
    old, rollout, current, mask, adv = make_batch(seed=12, spread=0.3, with_bad=True)
    out = compute_correction(CorrectionConfig(**flags), old_logprobs=old, rollout_logprobs=rollout,
                             response_mask=mask, advantages=adv, current_logprobs=current)
    ref = naive_correction(flags, *as_lists(old, rollout, mask), adv.tolist(), current.tolist())
    valid = mask.bool().tolist()
    n = sum(map(sum, valid))
    seqs = [i for i, row in enumerate(valid) if any(row)]
    clipped = sum(ref.clipped[i][t] for i, row in enumerate(valid) for t, v in enumerate(row) if v)
    rejected = sum(ref.rejected[i][t] for i, row in enumerate(valid) for t, v in enumerate(row) if v)
    rejected_seqs = sum(any(ref.rejected[i]) for i in seqs)
    assert 0 < clipped < n and 0 < rejected < n and 0 < rejected_seqs <= len(seqs)  # the batch makes them act
    assert out.metrics["rollout_correction/clipped_frac"] == pytest.approx(clipped / n)
    assert out.metrics["rollout_correction/rejected_token_frac"] == pytest.approx(rejected / n)
    assert out.metrics["rollout_correction/rejected_seq_frac"] == pytest.approx(rejected_seqs / len(seqs))
    assert out.metrics["rollout_correction/nonfinite_frac"] == pytest.approx(3 / n)  # the three make_batch plants


def test_loss_contribution_split_by_advantage_sign():
    cfg = CorrectionConfig(log_rollout_offpolicy_metrics=True)
    old, rollout, current, mask, adv = make_batch(seed=13)
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current)
    n = mask.sum()
    c = -(torch.exp(current - old) - 1) * adv[:, None] * mask
    assert out.metrics["rollout_correction/loss_contrib_pos"] == pytest.approx(
        (c * (adv[:, None] > 0)).sum().item() / n.item(), rel=1e-5)
    assert out.metrics["rollout_correction/loss_contrib_neg"] == pytest.approx(
        (c * (adv[:, None] < 0)).sum().item() / n.item(), rel=1e-5)
    c_roll = -(torch.exp(current - rollout) - 1) * adv[:, None] * mask
    assert out.metrics["rollout_correction/loss_contrib_rollout_pos"] + out.metrics[
        "rollout_correction/loss_contrib_rollout_neg"] == pytest.approx(c_roll.sum().item() / n.item(), rel=1e-4)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("clip_c", [None, 3.0])
@pytest.mark.parametrize("flags", [CONFIGS[1], CONFIGS[7], REJECTIONS[-1]])
def test_policy_loss_matches_naive(agg, clip_c, flags):
    cfg = CorrectionConfig(**flags)
    old, rollout, current, mask, adv = make_batch(seed=21, spread=0.15)
    current = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * 0.4
    current[adv < 0, 0] += 1.5  # r > e^1.5 > clip_ratio_c on a negative-advantage token: the dual clip binds
    current.requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current, with_metrics=True)
    loss, metrics = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=adv, correction=out,
                                clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_c, loss_agg_mode=agg)
    ref = naive_everything(flags, *as_lists(old, rollout, mask), adv.tolist(), current.tolist(),
                           eps_low=0.2, eps_high=0.28, clip_c=clip_c, agg=agg)
    assert loss.item() == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor(ref["grad"]), rtol=1e-5, atol=1e-7)
    assert_metrics_match(metrics, ref["metrics"])
    assert ref["metrics"]["policy/pg_clipfrac"] > 0  # the batch makes the clip act
    if clip_c is not None:
        assert ref["metrics"]["policy/pg_clipfrac_lower"] > 0


def test_gradient_matches_autograd_of_naive_formula():
    """The weights scale the gradient of each token's surrogate and carry none themselves."""
    flags = dict(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=1.2)
    cfg = CorrectionConfig(**flags)
    old, rollout, _, mask, adv = make_batch(seed=8)
    current = old.clone().requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=adv, correction=out)
    loss.backward()
    # At current == old the ratio is 1 (no clipping), so d loss / d logp_t = -A w_t / N (w from the naive reference).
    w = torch.tensor(naive_correction(flags, *as_lists(old, rollout, mask)).weights)
    assert (w < 1.2).any() and (w == 1.2).any()  # some truncated, some not
    expected = -adv[:, None] * w * mask / mask.sum()
    torch.testing.assert_close(current.grad, expected, rtol=1e-5, atol=1e-7)


def test_bypass_uses_rollout_as_old_and_current_for_rejection():
    cfg = CorrectionConfig(old_logprob_source="bypass", rollout_rejection=["token_k3"], rollout_rejection_threshold=0.01)
    old, rollout, current, mask, adv = make_batch(seed=9)
    out = compute_correction(cfg, old_logprobs=None, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current)
    assert out.old_logprobs is rollout
    lr = (current - rollout)
    k3 = lr.exp() - 1 - lr
    assert out.mask.bool().tolist() == ((k3 <= 0.01) & mask.bool()).tolist()
    loss, _ = policy_loss(cfg, current_logprobs=current, advantages=adv, correction=out)
    ref, _ = policy_loss(CorrectionConfig(), current_logprobs=current, old_logprobs=rollout, advantages=adv,
                         response_mask=out.mask)
    assert loss.item() == pytest.approx(ref.item())


def test_no_mode_means_unit_weights_and_unchanged_mask():
    cfg = CorrectionConfig()
    old, rollout, current, mask, adv = make_batch(seed=10)
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    assert torch.equal(out.weights, torch.ones_like(old))
    assert torch.equal(out.mask, mask)
    assert out.metrics == {}


def test_mask_dtype_is_preserved():
    cfg = CorrectionConfig(rollout_rejection=["token_k2"], rollout_rejection_threshold=0.01)
    old, rollout, current, mask, adv = make_batch(seed=1)
    for m in (mask.bool(), mask.long(), mask.to(torch.bfloat16)):
        out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=m)
        assert out.mask.dtype == m.dtype


def test_bf16_inputs_are_upcast():
    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate")
    old, rollout, current, mask, adv = make_batch(seed=2)
    out16 = compute_correction(cfg, old_logprobs=old.bfloat16(), rollout_logprobs=rollout.bfloat16(),
                               response_mask=mask)
    out32 = compute_correction(cfg, old_logprobs=old.bfloat16().float(), rollout_logprobs=rollout.bfloat16().float(),
                               response_mask=mask)
    assert out16.weights.dtype == torch.float32
    torch.testing.assert_close(out16.weights, out32.weights)


def test_dual_clip_holds_its_value_at_huge_ratios():
    """min(L, -cA) at r = e^19: the float form L - max(L + cA, 0) cancelled to 0 or 32 in fp32."""
    old = torch.tensor([[-20.0, -1.0, -1.0]])
    current = torch.tensor([[-1.0, -1.0, -1.5]], requires_grad=True)
    adv = torch.tensor([-1.0])
    loss, metrics = policy_loss(CorrectionConfig(), current_logprobs=current, old_logprobs=old, advantages=adv,
                                response_mask=torch.ones(1, 3), clip_ratio_c=3.0)
    ref, grad, ref_metrics = naive_ppo(current.tolist(), old.tolist(), adv.tolist(), [[1.0] * 3], [[True] * 3],
                                       0.2, 0.2, 3.0)
    assert loss.item() == pytest.approx(ref, rel=1e-6)
    assert metrics["policy/pg_clipfrac_lower"] == pytest.approx(1 / 3) == ref_metrics["policy/pg_clipfrac_lower"]
    loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor(grad))
    assert current.grad[0, 0] == 0  # the dual-clipped token carries no gradient


def test_off_policy_drift_ignores_a_nan_current_logprob():
    """A NaN π_θ drifts 0: it was read as logprob 0, so δ_i fell by |log π_rollout| / n."""
    flags = dict(off_policy_sequence_mask_delta=0.05)
    old = -torch.ones(1, 4)
    rollout = old.clone()
    current = old - 0.2  # drift 0.2 > δ on every token
    current[0, 1] = float("nan")
    adv = torch.tensor([-1.0])
    out = compute_correction(CorrectionConfig(**flags), old_logprobs=old, rollout_logprobs=rollout,
                             response_mask=torch.ones(1, 4), advantages=adv, current_logprobs=current)
    ref = naive_correction(flags, old.tolist(), rollout.tolist(), [[1.0] * 4], adv.tolist(), current.tolist())
    assert ref.off_policy == [True]  # δ = 0.2 · 3/4 = 0.15 > 0.05
    assert out.off_policy_masked.tolist() == [True]
    assert out.metrics["rollout_correction/nonfinite_frac"] == pytest.approx(1 / 4)


def test_the_naive_reference_imports_nothing_from_the_package():
    """Its independence is the point: no shared parsing, no shared math."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).parent / "naive_reference.py").read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert modules <= {"__future__", "math", "dataclasses"}, modules


# (loss_agg_mode, an option of policy_loss): each option is set where it acts, and the loss differs from
# the one without it by more than the tolerance, so dropping it fails the comparison with the reference.
LOSS_OPTIONS = [
    ("seq-mean-token-sum-norm", dict(loss_scale_factor=3.0)),
    ("token-mean", dict(global_num_tokens=97.0)),
    ("seq-mean-token-mean", dict(global_num_seqs=11.0)),
    ("seq-mean-token-sum", dict(global_num_seqs=11.0)),
    ("seq-mean-token-sum-norm", dict(global_num_seqs=11.0)),
]
NAIVE_NAMES = {"loss_scale_factor": "scale_factor", "global_num_tokens": "num_tokens", "global_num_seqs": "num_seqs"}


@pytest.mark.parametrize("agg,options", LOSS_OPTIONS)
def test_policy_loss_denominators_match_naive(agg, options):
    """``loss_scale_factor`` (seq-mean-token-sum-norm's T) and the global counts of data-parallel
    normalisation, each against the reference with that denominator, loss and gradient."""
    flags = dict(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=1.3,
                 rollout_rejection=["token_k2"], rollout_rejection_threshold=0.02)
    cfg = CorrectionConfig(**flags)
    old, rollout, current, mask, adv = make_batch(seed=31, spread=0.2)
    current = current.clone().requires_grad_()
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current)
    loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=adv, correction=out,
                          loss_agg_mode=agg, **options)
    loss.backward()
    ref = naive_correction(flags, *as_lists(old, rollout, mask), adv.tolist(), current.tolist())
    args = (current.tolist(), old.tolist(), adv.tolist(), ref.weights, ref.keep, 0.2, 0.2)
    want, grad, _ = naive_ppo(*args, agg=agg, **{NAIVE_NAMES[k]: v for k, v in options.items()})
    plain, _, _ = naive_ppo(*args, agg=agg)
    assert abs(want - plain) > 0.1 * abs(plain) > 0  # the option changes the loss here
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-8)
    torch.testing.assert_close(current.grad, torch.tensor(grad), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_a_sequence_ratio_past_the_bound_is_clamped_to_it(mode):
    """log rho = 30 (three tokens at log r = 10, product) is clamped to 20 before exp (docs/flags.md): under a
    cap of 1e10 (between e^20 and e^30) the sequence keeps weight e^20 instead of being masked or capped."""
    flags = dict(rollout_importance_sampling_mode=mode, rollout_importance_sampling_threshold=1e10,
                 rollout_importance_sampling_sequence_reduction="product",
                 rollout_importance_sampling_sequence_mask_weight="sequence", log_rollout_offpolicy_metrics=True)
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    rollout = old - torch.tensor([[10.0, 10.0, 10.0], [0.1, 0.0, -0.1]])
    mask = torch.ones(2, 3)
    out = compute_correction(CorrectionConfig(**flags), old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    ref = naive_correction(flags, *as_lists(old, rollout, mask))
    assert ref.seq_log_ratio[0] == 20.0
    torch.testing.assert_close(out.weights, torch.tensor(ref.weights), rtol=1e-5, atol=0)
    assert out.weights[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert out.sequence_log_ratio.tolist() == pytest.approx([20.0, 0.0], abs=1e-6)


def test_policy_loss_without_metrics_returns_the_same_loss_and_no_metrics():
    cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate", log_rollout_offpolicy_metrics=True)
    old, rollout, current, mask, adv = make_batch(seed=32)
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current)
    loss, metrics = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=adv, correction=out)
    quiet, none = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=adv, correction=out,
                              with_metrics=False)
    assert none == {} and "policy/pg_clipfrac" in metrics and "rollout_correction/kl" in metrics
    assert torch.equal(quiet, loss)
