"""The NeMo RL adapter beside NeMo RL's own ``ClippedPGLossFn``, at v0.7.0 and at main (7ea279ab).

``RolloutParityLossFn`` wraps NeMo RL's loss: with the shared flags null it *is* NeMo RL's loss
(loss, gradient and every metric bit for bit, for every loss option NeMo RL has: KL k1/k2/k3,
its own IS types, sequence-level loss, dual clip, GSPO, CISPO, REINFORCE, on-policy KL, VAPO's
NLL term, forced on-policy ratio); with flags set only the correction changes, and the actor
term equals the core's. Both trees come from ``../shared/anchors/nemo-rl`` (support/nemo_anchor.py)
and are driven through NeMo RL's own ``BatchedDataDict`` and ``process_global_batch`` plus its
worker's microbatch loop and ``grpo_train``'s metric aggregation (support/nemo_harness.py).
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from rollout_parity.check.shared_batch import all_config_names, config_for, load_expected, make_shared_batch
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
from rollout_parity import CorrectionConfig, compute_correction, policy_loss
from rollout_parity.adapters.nemo_rl import (RolloutParityLossFn, check_nemo_rl_vllm_kwargs, correction_from_nemo_rl,
                                            diagnostics, nemo_rl_generation_config)
from rollout_parity.core.metric_names import nemo_rl_names

pytestmark = [pytest.mark.nemo_rl]

ADAPTER = Path(__file__).resolve().parents[1] / "rollout_parity" / "adapters" / "nemo_rl"
TOL = dict(rtol=1e-5, atol=1e-6)
APPROX = dict(rel=1e-5, abs=1e-6)
NO_KL = dict(reference_policy_kl_penalty=0.0)


@pytest.fixture(scope="module", params=VERSIONS)
def nemo(request):
    skip_unless_available()
    with ANCHORS.activate(request.param) as ns:
        yield load(ns)


# ----------------------------------------------------------------- batches


def base_batch(kind: str):
    """The shared batch (8 x 12, ragged, one empty row), sample 2 masked by sample_mask.

    ``finite``: the engine's NaN/−inf replaced by ordinary values. ``nonfinite``: NaN, −inf
    and +inf engine logprobs on three valid tokens."""
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
    data["reference_policy_logprobs"][:, 1:] = b.old_logprobs - 0.2  # a KL term that is not ~0
    data["rewards"] = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])  # VAPO's NLL term
    return data, current


def agreed_rollout(kind: str):
    """The engine's non-finite logprobs replaced by the trainer's: the batch NeMo RL's metrics
    describe through the adapter."""
    b, rollout, _ = base_batch(kind)
    return torch.where(torch.isfinite(rollout), rollout, b.old_logprobs)


def run(ns, loss_fn, kind, rollout=None, mbs=2):
    data, current = make_data(ns, kind, rollout)
    total, mb_metrics = train_step(ns, loss_fn, data, mbs)
    return total, current.grad, aggregate(mb_metrics)


#: NeMo RL loss options, each a ``loss_fn`` block of NeMo RL's own keys.
NEMO_CASES = {
    "kl_k3": dict(reference_policy_kl_penalty=0.01, reference_policy_kl_type="k3"),
    "kl_k1": dict(reference_policy_kl_penalty=0.01, reference_policy_kl_type="k1"),
    "kl_k2_seq_level_dual_clip": dict(reference_policy_kl_penalty=0.01, reference_policy_kl_type="k2",
                                      token_level_loss=False, ratio_clip_c=3.0, ratio_clip_max=0.28),
    "plain_is": dict(NO_KL, use_importance_sampling_correction=True),
    "tis_floor_dual_clip_kl": dict(reference_policy_kl_penalty=0.01, use_importance_sampling_correction=True,
                                   truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.2,
                                   truncated_importance_sampling_ratio_min=0.9, ratio_clip_c=3.0),
    "icepop": dict(NO_KL, use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                   truncated_importance_sampling_ratio=1.1, truncated_importance_sampling_ratio_min=0.9),
    "seq_mask_tis": dict(NO_KL, use_importance_sampling_correction=True,
                         truncated_importance_sampling_type="seq-mask-tis",
                         truncated_importance_sampling_ratio=1.02, truncated_importance_sampling_ratio_min=0.98),
    "gspo_kl": dict(reference_policy_kl_penalty=0.01, sequence_level_importance_ratios=True,
                    token_level_loss=False, use_importance_sampling_correction=True),
    "cispo": dict(NO_KL, use_cispo=True),
    "reinforce": dict(NO_KL, disable_ppo_ratio=True),
    "on_policy_kl_vapo": dict(reference_policy_kl_penalty=0.01, use_on_policy_kl_approximation=True,
                              positive_example_nll_weight=0.1),
    "forced_on_policy": dict(NO_KL, force_on_policy_ratio=True),
}
# NeMo RL's metrics that read generation_logprobs (NaN/inf on a batch with NaN/inf there).
GEN_METRICS = ("token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error",
               "approx_entropy")


def ours_from(keys: dict, flags: dict | None = None, **kwargs) -> RolloutParityLossFn:
    """Built as grpo.setup() builds it under the hook: a loss_fn block with our keys."""
    return RolloutParityLossFn.from_nemo_config(
        {**keys, "rollout_parity": "rollout-parity", "rollout_correction": dict(flags or {})}, **kwargs)


# ----------------------------------------------------------------- flags null: NeMo RL's own loss


@pytest.mark.parametrize("case", sorted(NEMO_CASES))
def test_flags_null_is_nemo_rls_own_loss_bit_for_bit(nemo, case):
    keys = NEMO_CASES[case]
    their_loss, their_grad, theirs = run(nemo, nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**keys)), "finite")
    ours_fn = ours_from(keys)
    our_loss, our_grad, ours = run(nemo, ours_fn, "finite")
    assert ours_fn.loss_type == ours_fn.nemo_loss_fn.loss_type and ours_fn.input_type == ours_fn.nemo_loss_fn.input_type
    assert math.isfinite(their_loss) and bool(their_grad.abs().sum() > 0)
    assert our_loss == their_loss
    assert torch.equal(our_grad, their_grad)
    assert ours == theirs  # every key, every value
    assert all(key in ours for key in GRPO_READS)


@pytest.mark.parametrize("case", ["kl_k3", "plain_is", "tis_floor_dual_clip_kl", "icepop", "seq_mask_tis",
                                  "gspo_kl", "on_policy_kl_vapo"])
def test_nonfinite_engine_logprobs_nemos_loss_finite_metrics(nemo, case):
    """NaN, −inf, +inf engine logprobs: the loss is NeMo RL's own (its IS weighs them 0, or
    ``tis``'s floor), and so is the gradient wherever NeMo RL's is finite: its on-policy KL
    approximation turns a −inf into a NaN gradient, ours stays finite. NeMo RL's metrics, NaN/inf
    in its own run, come from the batch where the engine agreed with π_old on those tokens."""
    keys = NEMO_CASES[case]
    their_loss, their_grad, theirs = run(nemo, nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**keys)), "nonfinite")
    _, _, agreed = run(nemo, nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**keys)), "nonfinite",
                       rollout=agreed_rollout("nonfinite"))
    our_loss, our_grad, ours = run(nemo, ours_from(keys), "nonfinite")
    assert math.isfinite(their_loss) and bool(torch.isfinite(our_grad).all())
    assert our_loss == pytest.approx(their_loss, rel=1e-6, abs=1e-9)
    finite = torch.isfinite(their_grad)
    assert bool(finite.all()) == (case != "on_policy_kl_vapo")  # NeMo RL's own NaN gradient, measured
    torch.testing.assert_close(our_grad[finite], their_grad[finite], rtol=1e-6, atol=1e-9)
    assert any(not math.isfinite(theirs[k]) for k in GEN_METRICS)  # NeMo RL's own: NaN/inf
    assert finite_or_sentinel(ours) == []
    assert set(ours) == set(theirs)
    for key in ours:
        expected = ours["loss"] if key == "loss" else agreed[key]
        assert ours[key] == pytest.approx(expected, **APPROX), key


# ----------------------------------------------------------------- flags set: only the correction changes


def core_actor_loss(ns, keys, flags, kind="finite"):
    """The core's corrected policy loss and gradient on the batch, with NeMo RL's global
    denominators and clip settings (no KL): the independent reference of the actor term."""
    b, rollout, sample_mask = base_batch(kind)
    data, current = make_data(ns, kind)
    cfg = CorrectionConfig(**flags)
    mask = b.response_mask * sample_mask[:, None]
    out = compute_correction(cfg, old_logprobs=b.old_logprobs, rollout_logprobs=rollout, response_mask=mask,
                             advantages=data["advantages"][:, 1:], current_logprobs=current.detach())
    token_level = keys.get("token_level_loss", True)
    loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=b.old_logprobs,
                          advantages=data["advantages"][:, 1:], correction=out, response_mask=mask,
                          clip_ratio_low=keys.get("ratio_clip_min", 0.2), clip_ratio_high=keys.get("ratio_clip_max", 0.2),
                          clip_ratio_c=keys.get("ratio_clip_c"),
                          loss_agg_mode="token-mean" if token_level else "seq-mean-token-mean",
                          global_num_tokens=float(mask.sum()) if token_level else None,
                          global_num_seqs=None if token_level else float(sample_mask.sum()))
    loss.backward()
    return float(loss.detach()), current.grad, out


FLAG_CASES = {
    "token_truncate": dict(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=1.2),
    "sequence_mask": dict(rollout_importance_sampling_mode="sequence_mask", rollout_importance_sampling_threshold=1.05,
                          rollout_importance_sampling_threshold_lower=0.95),
    "tis_srs_k3": CorrectionConfig.preset("tis_srs_k3").to_dict(),
    "k1_k2_rejection_off_policy": dict(rollout_rejection=["token_k2", "seq_mean_k1"],
                                       rollout_rejection_threshold=[0.5, "0.9_1.1"],
                                       off_policy_sequence_mask_delta=0.02),
}


@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
@pytest.mark.parametrize("flags", sorted(FLAG_CASES))
@pytest.mark.parametrize("level", ["token", "sequence_dual_clip"])
def test_flags_change_only_the_correction(nemo, kl, flags, level):
    """With NeMo RL's KL penalty at 0.01: the KL term is NeMo RL's (on the tokens the correction
    keeps), the actor term is the core's corrected loss, and NeMo RL's metrics are its own."""
    keys = dict(reference_policy_kl_penalty=0.01, reference_policy_kl_type=kl)
    if level != "token":
        keys.update(token_level_loss=False, ratio_clip_c=3.0, ratio_clip_max=0.28)
    no_kl = {**keys, "reference_policy_kl_penalty": 0.0}
    flag_set = FLAG_CASES[flags]
    total, grad, ours = run(nemo, ours_from(keys, flag_set), "finite")
    total0, grad0, _ = run(nemo, ours_from(no_kl, flag_set), "finite")
    core_loss, core_grad, out = core_actor_loss(nemo, keys, flag_set)
    # The actor term is the core's corrected loss.
    assert total0 == pytest.approx(core_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad0, core_grad, rtol=1e-5, atol=1e-7)
    # The KL term is NeMo RL's own, on the tokens the correction keeps (NeMo RL's global counts
    # are fixed before the loss, from the batch as sampled).
    nemo_kl = []
    for penalty in (0.01, 0.0):
        data, current = make_data(nemo, "finite")
        fn = nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**{**keys, "reference_policy_kl_penalty": penalty}))
        batch, gvs, gvt = global_counts(nemo, data, fn)
        batch["token_mask"][:, 1:] *= ((out.mask > 0) | (batch["sample_mask"][:, None] == 0)).float()
        loss, metrics = fn(next_token_logprobs=current, data=batch, global_valid_seqs=gvs, global_valid_toks=gvt)
        loss.backward()
        nemo_kl.append((float(loss.detach()), current.grad, aggregate([metrics])))
    assert total - total0 == pytest.approx(nemo_kl[0][0] - nemo_kl[1][0], rel=1e-5, abs=2e-7)  # fp32 sums
    torch.testing.assert_close(grad - grad0, nemo_kl[0][1] - nemo_kl[1][1], rtol=1e-4, atol=1e-7)
    # NeMo RL's metrics are its own on those tokens; ours are added beside them.
    for key, value in nemo_kl[0][2].items():
        if key != "loss":
            assert ours[key] == pytest.approx(value, **APPROX), key
    assert ours["kl_penalty"] > 0 and any(k.startswith("rollout_correction/") for k in ours)


def test_an_is_weight_only_leaves_nemos_metrics_and_kl_untouched(nemo):
    """An IS mode without rejection: every NeMo RL metric but the loss is what NeMo RL reports
    with the flags null (the weight rides on the advantages, which only the actor term reads)."""
    keys = NEMO_CASES["kl_k3"]
    _, _, null = run(nemo, ours_from(keys), "finite")
    _, _, ours = run(nemo, ours_from(keys, FLAG_CASES["token_truncate"]), "finite")
    for key, value in null.items():
        if key != "loss":
            assert ours[key] == value, key
    assert ours["loss"] != null["loss"]


def test_nemos_is_keys_in_shared_flags_reproduce_nemos_is(nemo):
    """correction_from_nemo_rl's table: NeMo RL's tis/icepop/seq-mask-tis written as shared
    flags give NeMo RL's own loss and gradient on a finite batch."""
    for case in ("tis_floor_dual_clip_kl", "icepop", "seq_mask_tis"):
        keys = NEMO_CASES[case]
        their_loss, their_grad, _ = run(nemo, nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**keys)), "finite")
        plain = {k: v for k, v in keys.items() if "importance_sampling" not in k}
        ours = ours_from(plain, correction_from_nemo_rl(keys).to_dict())
        our_loss, our_grad, _ = run(nemo, ours, "finite")
        assert our_loss == pytest.approx(their_loss, **APPROX), case
        torch.testing.assert_close(our_grad, their_grad, **TOL)


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
    loss_fn = RolloutParityLossFn(config_for(name), NO_KL, metrics="local")
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
        if key.startswith("rollout_correction/"):
            assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def test_from_nemo_config_metrics_local_gives_the_microbatchs_own_means(nemo):
    """``from_nemo_config(..., metrics="local")``: our diagnostics as this microbatch's own means (the core's
    numbers); the default ``"nemo"`` pre-divides them by NeMo RL's global counts, which NeMo RL then sums."""
    name = "tis_srs_k3"
    block = {**NO_KL, "rollout_parity": "rollout-parity", "rollout_correction": config_for(name).to_dict()}
    expected = load_expected()[name]["metrics"]
    _, data, _ = shared_data(nemo)
    _, local = train_step(nemo, RolloutParityLossFn.from_nemo_config(block, metrics="local"), data,
                          microbatch_size=8)
    _, data, _ = shared_data(nemo)
    _, shares = train_step(nemo, RolloutParityLossFn.from_nemo_config(block), data, microbatch_size=8)
    key = "rollout_correction/rejected_seq_frac"  # a sequence mean: the batch has an empty sample
    mask = make_shared_batch().response_mask
    n_seq, gvs = float((mask.sum(-1) > 0).sum()), float(mask.shape[0])
    assert n_seq < gvs and expected[key] > 0
    assert local[0][key] == pytest.approx(expected[key], rel=1e-6, abs=1e-6)
    assert shares[0][key] == pytest.approx(expected[key] * n_seq / gvs, rel=1e-6, abs=1e-6)


def core_to_nemo(name: str, core: dict, batch) -> dict:
    """The core's whole-batch diagnostics with NeMo RL's denominators (global valid tokens and
    samples); an empty sample counts as on-policy. Independent of any microbatching."""
    mask = batch.response_mask
    gvs = float(mask.shape[0])
    n_seq = float((mask.sum(-1) > 0).sum())
    finite = mask * torch.isfinite(batch.rollout_logprobs)
    n_ppl = float((finite.sum(-1) > 0).sum())
    out = {}
    for key, value in core.items():
        if not key.startswith("rollout_correction/"):
            continue
        short = key.split("/", 1)[1]
        if short in diagnostics.SEQ_MEANS:
            out[key] = value * n_seq / gvs
        elif short in ("log_ppl_diff", "log_ppl_abs_diff"):
            out[key] = value * n_ppl / gvs
        elif short == "ppl_ratio":
            out[key] = ((value - 1.0) * n_ppl + gvs) / gvs
        elif short in diagnostics.LEFT_OUT:
            continue
        else:
            assert short in diagnostics.TOKEN_MEANS, key
            out[key] = value
    return out


def test_every_core_diagnostic_is_summed_or_left_out_by_name():
    """A diagnostic the core adds must be classified before NeMo RL sums it."""
    from rollout_parity.check.shared_batch import core_reference

    classes = [diagnostics.TOKEN_MEANS, diagnostics.SEQ_MEANS, diagnostics.PPL_MEANS, diagnostics.LEFT_OUT]
    for key in core_reference("tis_srs_k3")["metrics"]:
        if key.startswith("rollout_correction/"):
            assert sum(key.split("/", 1)[1] in c for c in classes) == 1, key


@pytest.mark.parametrize("name", ["tis_srs_k3", "icepop", "sequence_mask_token", "k1_k2_rejection",
                                  "off_policy_mask"])
def test_metrics_are_the_global_batch_for_any_microbatching(nemo, name):
    """NeMo RL sums every metric over microbatches: the sums equal the whole batch's metrics
    (sequence metrics included), NeMo RL's own and ours."""
    batch = make_shared_batch()
    expected = core_to_nemo(name, load_expected()[name]["metrics"], batch)
    runs = {}
    for mbs in (1, 2, 4, 8):
        _, data, current = shared_data(nemo)
        loss_fn = RolloutParityLossFn(config_for(name), NO_KL)
        total, mb_metrics = train_step(nemo, loss_fn, data, mbs)
        runs[mbs] = (total, current.grad, aggregate(mb_metrics))
    # where NeMo RL's own loss logs one of our quantities (its gen_kl_error, ...), ours give way to it
    expected = nemo_rl_names(expected, loss_fn.correction, loss_fn.nemo_settings)
    total8, grad8, metrics8 = runs[8]
    for key, value in expected.items():
        assert metrics8[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for mbs, (total, grad, metrics) in runs.items():
        assert total == pytest.approx(total8, rel=1e-5, abs=1e-7), mbs
        torch.testing.assert_close(grad, grad8, rtol=1e-5, atol=1e-7)
        for key, value in metrics8.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (mbs, key)


class _CountedLoss:
    """NeMo RL's loss as the hand-over calls it, with the host reads of its own calls counted apart (a mode inside
    another: both count a read, so ours are the outer count minus these)."""

    def __init__(self, loss_fn):
        self.loss_fn, self.calls, self.reads = loss_fn, 0, 0

    def __call__(self, *args, **kwargs):
        from rollout_parity.testing.host_sync import host_syncs

        self.calls += 1
        with host_syncs() as counts:
            result = self.loss_fn(*args, **kwargs)
        self.reads += sum(counts.values())
        return result

    def __getattr__(self, name):
        return getattr(self.loss_fn, name)


@pytest.mark.parametrize("kind", ["finite", "nonfinite"])
@pytest.mark.parametrize("flags", ["tis_srs_k3", "k1_k2_rejection_off_policy"])
def test_the_hand_over_reads_the_device_back_once_per_microbatch(nemo, flags, kind):
    """Host syncs (counted on CPU, rollout_parity/testing/host_sync.py) of one microbatch's loss call beyond
    NeMo RL's own loss: one, for our diagnostics, the counts they are scaled by, the loss and the check for
    non-finite engine logprobs together. With those (``nonfinite``) NeMo RL's loss runs a second time, for
    finite metrics."""
    from rollout_parity.testing.host_sync import host_syncs

    ours_fn = ours_from(NEMO_CASES["kl_k3"], FLAG_CASES[flags])
    data, _ = make_data(nemo, kind)
    batch, gvs, gvt = global_counts(nemo, data, ours_fn)
    mb = next(iter(batch.make_microbatch_iterator(4)))
    theirs = ours_fn.__dict__["nemo_loss_fn"] = _CountedLoss(ours_fn.nemo_loss_fn)
    with host_syncs() as counts:
        _, metrics = ours_fn(next_token_logprobs=mb["next_token_logprobs"].detach(), data=mb,
                             global_valid_seqs=gvs, global_valid_toks=gvt)
    assert "rollout_correction/nonfinite_frac" in metrics and theirs.reads > 0
    assert theirs.calls == (2 if kind == "nonfinite" else 1)
    assert sum(counts.values()) - theirs.reads == 1, (dict(counts), theirs.reads)


@pytest.mark.parametrize("kl, ours", [("k3", "k3_kl"), ("k1", "k1_mean")])
def test_ours_give_way_where_nemos_own_metric_is_the_same_quantity(nemo, kl, ours):
    """Diagnostics only (no IS mode, nothing removed), NeMo RL's own truncation off, token-level ratios: NeMo RL's
    ``gen_kl_error`` (its ``reference_policy_kl_type`` estimator) and ``sampling_importance_ratio`` are our
    ``k3_kl`` / ``k1_mean`` and ``is_weight_mean`` over the same tokens (the core's numbers, ``metrics="local"`` on
    one microbatch), so ours are left out (core/metric_names.py). With rejection NeMo RL's cover the kept tokens
    only: they differ, and ours stay."""
    keys = dict(NO_KL, reference_policy_kl_type=kl)
    flags = {"log_rollout_offpolicy_metrics": True}
    _, _, logged = run(nemo, ours_from(keys, flags), "finite")
    _, _, local = run(nemo, ours_from(keys, flags, metrics="local"), "finite", mbs=8)
    assert f"rollout_correction/{ours}" not in logged and "rollout_correction/is_weight_mean" not in logged
    assert "rollout_correction/delta_abs_mean" in logged  # the others stay
    assert logged["gen_kl_error"] == pytest.approx(local[f"rollout_correction/{ours}"], rel=1e-5, abs=1e-7)
    assert logged["sampling_importance_ratio"] == pytest.approx(local["rollout_correction/is_weight_mean"],
                                                                rel=1e-5, abs=1e-7)
    rejecting = {**flags, "rollout_rejection": ["token_k2"], "rollout_rejection_threshold": 0.02}
    _, _, kept = run(nemo, ours_from(keys, rejecting), "finite")
    _, _, kept_local = run(nemo, ours_from(keys, rejecting, metrics="local"), "finite", mbs=8)
    assert f"rollout_correction/{ours}" in kept
    assert kept_local["rollout_correction/rejected_token_frac"] > 0
    assert kept["gen_kl_error"] != pytest.approx(kept_local[f"rollout_correction/{ours}"], rel=1e-3)


def test_metric_normalizations_reproduce_the_sync_metrics_in_the_split_step(nemo):
    """Main's Megatron split step calls the loss with placeholder global counts 1 and rescales
    each metric by the denominator ``metric_normalizations`` names: NeMo RL's own table for its
    metrics, ours for ours."""
    if nemo.MetricNormalizer is None:  # v0.7.0: no split step, nothing to advertise
        assert not hasattr(RolloutParityLossFn(), "metric_normalizations")
        return
    keys = NEMO_CASES["seq_mask_tis"]
    for loss_fn in (ours_from(keys, {"rollout_rejection": ["seq_sum_k3"], "rollout_rejection_threshold": 0.01}),
                    RolloutParityLossFn(config_for("tis_srs_k3"), dict(NO_KL, token_level_loss=False)),
                    nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**keys))):
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
        assert set(loss_fn.metric_normalizations) >= set(raw[0])
        split = aggregate(split_step_rescale(nemo, loss_fn, raw, gvs, gvt))
        expected = aggregate(sync)
        for key, value in split.items():
            assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (type(loss_fn).__name__, key)


# ----------------------------------------------------------------- NeMo RL's loss-input paths


@pytest.mark.parametrize("case", ["tis_floor_dual_clip_kl", "kl_k2_seq_level_dual_clip"])
def test_logits_through_nemo_prepare_loss_input(nemo, case):
    """From logits: NeMo RL's own ``prepare_loss_input`` (``algorithms/loss/utils.py``) turns
    them into next-token logprobs for the wrapper, as its workers do, and the gradient reaches
    the logits as for NeMo RL's own loss (flags null) and as the core's (flags set)."""
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
                sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0]), reference_policy_logprobs=prev - 0.1)
    theirs, ours = _through_prepare_loss_input(nemo, NEMO_CASES[case], base, data)
    assert torch.equal(ours["loss"], theirs["loss"]) and torch.equal(ours["grad"], theirs["grad"])
    assert bool(theirs["grad"].abs().sum() > 0) and ours["metrics"] == theirs["metrics"]


def _through_prepare_loss_input(nemo, keys: dict, base, data: dict, **prepare_kwargs) -> tuple[dict, dict]:
    """NeMo RL's own loss and ours (flags null) each from the logits ``base`` through NeMo RL's
    ``prepare_loss_input``, a loss call and its backward: loss, logits' gradient, metrics, the batch the loss got
    and its ``next_token_logprobs``."""
    prepare = nemo.load("nemo_rl.algorithms.loss.utils").prepare_loss_input
    out = []
    for loss_fn in (nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**keys)), ours_from(keys)):
        logits = base.clone().requires_grad_(True)
        batch = nemo.BatchedDataDict({k: v.clone() for k, v in data.items()})
        with cpu_cuda():  # it moves the token ids to the GPU
            loss_input, batch = prepare(logits, batch, loss_fn, **prepare_kwargs)
        gvs = batch["sample_mask"].sum()
        gvt = (batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum()
        loss, metrics = loss_fn(data=batch, global_valid_seqs=gvs, global_valid_toks=gvt, **loss_input)
        loss.backward()
        out.append(dict(loss=loss.detach(), grad=logits.grad, metrics=metrics, batch=batch,
                        logprobs=loss_input["next_token_logprobs"].detach()))
    return out[0], out[1]


@pytest.mark.parametrize("case", ["tis_floor_dual_clip_kl", "kl_k3"])
def test_sampler_filtered_logprobs_through_nemo_prepare_loss_input(nemo, case):
    """With the rollout's top-k/top-p (``TrainingSamplingParams``), NeMo RL's ``prepare_loss_input`` filters the
    trainer's logits itself, masks what it filtered out of ``curr_logprobs`` and, for a loss with a KL penalty
    (read off the loss object, ``reference_policy_kl_penalty``), adds the unfiltered logprobs: the wrapper hands
    all of it to NeMo RL's loss (flags null), same loss and gradient. One sequence: NeMo RL's plain-tensor path
    views the logits without their last position, which only a single sequence leaves contiguous (its workers
    hand DTensor or vocab-parallel logits)."""
    params = nemo.load("nemo_rl.algorithms.logits_sampling_utils").TrainingSamplingParams(top_k=30, top_p=0.9)
    g = torch.Generator().manual_seed(4)
    S, V = 9, 40
    input_ids = torch.randint(0, V, (1, S), generator=g)
    base = torch.randn(1, S, V, generator=g) * 3
    lp = torch.log_softmax(base, -1)[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    prev = torch.cat([torch.zeros(1, 1), lp + 0.05 * torch.randn(1, S - 1, generator=g)], 1)
    data = dict(input_ids=input_ids, prev_logprobs=prev, generation_logprobs=prev + 0.1,
                token_mask=torch.cat([torch.zeros(1, 1), torch.ones(1, S - 1)], 1),
                advantages=torch.full((1, S), 0.7), sample_mask=torch.ones(1), reference_policy_logprobs=prev - 0.1)
    keys = NEMO_CASES[case]
    theirs, ours = _through_prepare_loss_input(nemo, keys, base, data, sampling_params=params)
    unfiltered = [("curr_logprobs_unfiltered" in x["batch"]) for x in (theirs, ours)]
    assert unfiltered == [keys.get("reference_policy_kl_penalty", 0) != 0] * 2
    assert torch.equal(ours["loss"], theirs["loss"]) and torch.equal(ours["grad"], theirs["grad"])
    assert ours["metrics"] == theirs["metrics"] and bool(theirs["grad"].abs().sum() > 0)
    assert (theirs["logprobs"] - lp).abs().max() > 1e-3  # the filter ran: renormalised over the kept set


def test_fused_linear_logprobs_reach_the_wrapper_through_nemos_code(nemo):
    """Main's Megatron ``use_fused_linear_logprobs``: setup() passes the flag to the loss, and
    ``prepare_loss_input`` (and the sequence-packing wrapper) read it off the loss object to hand
    over precomputed logprobs. The wrapper carries NeMo RL's attribute and gives NeMo RL's loss on
    them (flags null) or the core's actor term (flags set). v0.7.0 has no such flag."""
    fn = nemo.ClippedPGLossFn
    if "use_fused_linear_logprobs" not in fn.__init__.__code__.co_varnames:
        with pytest.raises(TypeError):
            ours_from(NO_KL, use_fused_linear_logprobs=True)
        return
    prepare = nemo.load("nemo_rl.algorithms.loss.utils").prepare_loss_input
    keys = NEMO_CASES["kl_k3"]
    ours = ours_from(keys, use_fused_linear_logprobs=True)
    assert ours.use_fused_linear_logprobs is True
    results = []
    for loss_fn in (fn(nemo.ClippedPGLossConfig(**keys), use_fused_linear_logprobs=True), ours):
        data, current = make_data(nemo, "finite")
        fused = torch.cat([current, torch.zeros(current.shape[0], 1)], dim=1)  # the fused forward's (B, S)
        loss_input, data = prepare(fused, data, loss_fn)
        assert loss_input["next_token_logprobs"].shape == current.shape
        _, gvs, gvt = global_counts(nemo, data, loss_fn)
        loss, metrics = loss_fn(data=data, global_valid_seqs=gvs, global_valid_toks=gvt, **loss_input)
        loss.backward()
        results.append((loss.detach(), current.grad, metrics))
    (theirs, their_grad, their_metrics), (mine, my_grad, my_metrics) = results
    assert torch.equal(mine, theirs) and torch.equal(my_grad, their_grad) and my_metrics == their_metrics


def test_recipe_routing():
    gen = nemo_rl_generation_config()["policy"]
    assert gen["generation"]["vllm_cfg"] == {"enable_prefix_caching": False,
                                             "logprobs_mode": "processed_logprobs"}
    assert gen["generation"]["vllm_kwargs"] == {"async_scheduling": False}
    assert "hf_config_overrides" not in gen
    cached = nemo_rl_generation_config(prefix_cache_policy="reset")["policy"]  # kept on, reset per update
    assert cached["generation"]["vllm_cfg"]["enable_prefix_caching"] is True and "hf_config_overrides" not in cached
    with pytest.raises(ValueError, match="vllm_cfg"):
        check_nemo_rl_vllm_kwargs({"logprobs_mode": "processed_logprobs"})


# ----------------------------------------------------------------- construction and bad input


@pytest.mark.parametrize("flags", [dict(weight_sync_check_interval=1), dict(moe_routing_replay=True)],
                         ids=["sync_check", "routing_replay"])
def test_engine_side_flags_are_refused_by_the_loss_not_dropped(nemo, flags):
    """NeMo RL hands rollout-parity only its loss: a flag that acts on the weight sync or the routers is refused."""
    with pytest.raises(ValueError, match=f"{next(iter(flags))}=.*NeMo RL's loss function has no hook"):
        RolloutParityLossFn(CorrectionConfig(**flags), NO_KL)
    with pytest.raises(ValueError, match="NeMo RL's loss function has no hook"):
        RolloutParityLossFn.from_nemo_config({**NO_KL, "rollout_correction": flags})


def test_refusals_name_the_keys(nemo):
    tis = dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
               truncated_importance_sampling_ratio=2.0)
    with pytest.raises(ValueError, match="twice.*truncated_importance_sampling_type"):
        ours_from(tis, {"rollout_importance_sampling_mode": "token_truncate"})
    with pytest.raises(ValueError, match="unknown flag loss_fn.rollout_correction.rollout_is_mode"):
        ours_from(NO_KL, {"rollout_is_mode": "x"})
    # Our own entry reads a recipe's block as written: the guard only stops NeMo RL's reading.
    raw = RolloutParityLossFn.from_nemo_config({"rollout_parity": "${rollout_parity:}", "rollout_correction": {}})
    assert raw.correction == CorrectionConfig()
    with pytest.raises(ValueError, match="mapping"):
        RolloutParityLossFn.from_nemo_config({"rollout_correction": "tis_srs_k3"})
    with pytest.raises(ValueError, match="from_nemo_config"):
        RolloutParityLossFn(None, nemo.ClippedPGLossConfig(rollout_correction={}))
    with pytest.raises(ValueError, match="metrics"):
        RolloutParityLossFn(metrics="global")
    # NeMo RL's own checks stay NeMo RL's (its assertion, raised from its __init__).
    with pytest.raises(AssertionError, match="use_importance_sampling_correction"):
        ours_from({"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0})
    # NeMo RL's own IS keys without an IS mode of ours: they act, with our rejection beside.
    both = ours_from(tis, {"rollout_rejection": ["seq_sum_k3"], "rollout_rejection_threshold": 0.01})
    assert both.nemo_loss_fn.truncated_importance_sampling_type == "tis"
    # Refused before NeMo RL's loss (and, in grpo.setup(), before any worker) is built; no half measure.
    with pytest.raises(ValueError, match="rollout_correction.fp32_lm_head=True cannot be served on NeMo RL.*"
                                         "autocast.*MixedPrecisionPolicy"):
        ours_from(NO_KL, {"fp32_lm_head": True})
    with pytest.raises(ValueError, match="rollout_sampling_replay=True: NeMo RL's generation"):
        ours_from(NO_KL, {"rollout_importance_sampling_mode": "token_truncate", "rollout_sampling_replay": True})


def test_async_and_fp8_switch_turns_into_our_weight_applied_once(nemo):
    """``use_importance_sampling_correction: true`` (what async GRPO and FP8 vLLM assert) with
    an IS mode of ours: NeMo RL's IS is off inside, ours applies once, exactly as with the switch
    off; NeMo RL's plain IS on top would have multiplied the weights twice."""
    flags = FLAG_CASES["token_truncate"]
    with_switch = ours_from(dict(NO_KL, use_importance_sampling_correction=True), flags)
    assert with_switch.nemo_loss_fn.use_importance_sampling_correction is False
    a = run(nemo, with_switch, "finite")
    b = run(nemo, ours_from(NO_KL, flags), "finite")
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2]
    core_loss, _, _ = core_actor_loss(nemo, NO_KL, flags)
    assert a[0] == pytest.approx(core_loss, rel=1e-5, abs=1e-7)
    # Without an IS mode of ours the switch is NeMo RL's plain IS, acting as in NeMo RL.
    plain = run(nemo, ours_from(dict(NO_KL, use_importance_sampling_correction=True)), "finite")
    nemo_plain = run(nemo, nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(**NEMO_CASES["plain_is"])), "finite")
    assert plain[0] == nemo_plain[0] and plain[0] != a[0]


def test_bad_data_names_the_key_and_shape(nemo):
    data, current = make_data(nemo, "finite")
    loss_fn = ours_from(NO_KL, CorrectionConfig.preset("icepop").to_dict())
    with pytest.raises(ValueError, match=r"\[:, 1:\]"):
        loss_fn(torch.cat([current, current[:, :1]], dim=1), data, 7, 50)
    broken = nemo.BatchedDataDict(dict(data))
    del broken["generation_logprobs"]
    with pytest.raises(KeyError, match="generation_logprobs"):
        loss_fn(current, broken, 7, 50)


def test_no_hand_written_copy_of_nemos_metrics():
    """The adapter never computes NeMo RL's metrics: their names appear nowhere in its code. One exception, on
    purpose: ``is_oob_ratio``, which NeMo RL logs for its own truncation (off while ours acts), is logged from OUR
    bounds under NeMo RL's name, defined once (test_nemo_rl_own_corrections.py checks its values)."""
    source = "\n".join(p.read_text() for p in ADAPTER.glob("*.py"))
    for name in ("probs_ratio", "token_mult_prob_error", "gen_kl_error", "policy_kl_error",
                 "js_divergence_error", "approx_entropy", "sampling_importance_ratio",
                 "kl_penalty", "num_valid_samples", "positive_nll_loss", "masked_mean", "calculate_kl"):
        assert not re.search(rf"(?<![\w]){name}(?![\w])", source), name
    assert re.findall(r"(?<![\w])is_oob_ratio(?![\w])", source) == ["is_oob_ratio"]
    assert 'OUT_OF_BOUNDS = "is_oob_ratio"' in (ADAPTER / "diagnostics.py").read_text()
    assert all(len(p.read_text().splitlines()) <= 400 for p in ADAPTER.glob("*.py"))


def test_missing_nemo_rl_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_rl.algorithms.loss.interfaces", None)
    with pytest.raises(ImportError, match=r"rollout-parity\[nemo-rl\]"):
        RolloutParityLossFn()
    from rollout_parity.adapters.nemo_rl import apply

    with pytest.raises(ImportError, match=r"rollout-parity\[nemo-rl\]"):
        apply()
