"""Everything verl's own rollout correction gives a verl user, with ours in place: each metric and option against
verl 0.9's own code on the same inputs (the pattern of ``test_anchor_verl.py``).

* every metric verl's ``compute_rollout_correction_and_rejection_mask`` returns, under its name with its value,
  from the driver's path (``verl_keys.verl_metrics``): ``rollout_corr/kl``, ``rollout_is_max/min/std``,
  ``rollout_is_ratio_fraction_low/high``, the ``rollout_is_seq_*`` group, ``rollout_rs_<option>_*``;
* verl's own keys (every ``RolloutCorrectionConfig`` preset verl ships) answered by the adapter: the same weights,
  mask and metrics; ``rollout_is_batch_normalize`` (self-normalised IS) there and in the driver hook;
* ``compute_offpolicy_metrics`` without rollout logprobs (``training_ppl``, ``training_log_ppl``) and
  ``compute_is_metrics`` on weights computed elsewhere;
* verl's ``bypass_mode`` loss, ``loss_type`` ``reinforce`` and ``ppo_clip``, with our flags: verl's loss, our
  correction inside it, equal to verl's own bypass loss with the same correction.
"""

from __future__ import annotations

import pytest
import torch

from rollout_parity.testing.stack import need

need("verl", extra="verl")

from verl import DataProto  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper as helper  # noqa: E402

from rollout_parity import CorrectionConfig, compute_correction  # noqa: E402
from rollout_parity.adapters import verl as adapter  # noqa: E402
from rollout_parity.adapters.verl import verl_keys  # noqa: E402
from integration_tests.support.verl_equivalent import verl_equivalent  # noqa: E402
from integration_tests.test_anchor_verl import IS_CASES, REJECTION_CASES, anchor_batch  # noqa: E402

pytestmark = [pytest.mark.verl]

TOL = 1e-5


def _verls(*args, **kwargs):
    """verl's own ``compute_rollout_correction_and_rejection_mask``, unwrapped (the adapter's wrapper passes
    through without flags; this makes sure)."""
    fn = getattr(helper.compute_rollout_correction_and_rejection_mask, "__wrapped__",
                 helper.compute_rollout_correction_and_rejection_mask)
    return fn(*args, **kwargs)


def assert_every_verl_metric(ours: dict, theirs: dict, missing_ok=()):
    """Every metric verl returned is in ours under its name, with its value."""
    lost = set(theirs) - set(ours) - set(missing_ok)
    assert not lost, sorted(lost)
    for key, value in theirs.items():
        if key in ours:
            assert ours[key] == pytest.approx(float(value), abs=TOL, rel=TOL), key


def _run_flags(cfg, old, rollout, mask):
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, with_metrics=True)
    return out, verl_keys.verl_metrics(cfg, out, mask)


def _run_verl(cfg, old, rollout, mask):
    keys = verl_equivalent(cfg)
    return _verls(old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, rollout_is=keys["rollout_is"],
                  rollout_is_threshold=keys["rollout_is_threshold"], rollout_rs=keys["rollout_rs"],
                  rollout_rs_threshold=keys["rollout_rs_threshold"])


@pytest.mark.parametrize("name", sorted(IS_CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_every_is_metric_verl_logs_is_logged_with_verls_value(name, seed):
    """The shared flags as verl would run them: rollout_is_max/min/std, ratio_fraction_low/high, the seq group."""
    cfg = IS_CASES[name]
    old, rollout, mask = anchor_batch(seed)
    out, ours = _run_flags(cfg, old, rollout, mask)
    _, _, theirs = _run_verl(cfg, old, rollout, mask)
    # verl's chi2_seq is the product ratio's; under our geometric default it keeps our name (a different formula)
    geometric = cfg.rollout_importance_sampling_sequence_reduction != "product"
    assert_every_verl_metric(ours, theirs, missing_ok={"rollout_corr/chi2_seq"} if geometric else ())
    for key in ("rollout_is_max", "rollout_is_min", "rollout_is_std", "rollout_is_ratio_fraction_low",
                "rollout_is_ratio_fraction_high", "rollout_is_seq_mean", "rollout_is_seq_std", "rollout_is_seq_max",
                "rollout_is_seq_min", "rollout_is_seq_max_deviation", "rollout_is_seq_fraction_high",
                "rollout_is_seq_fraction_low", "kl"):
        assert "rollout_corr/" + key in ours, key
    # verl's signed k1 under its name, beside ours
    assert ours["rollout_corr/kl"] == ours["rollout_correction/k1_mean"]


@pytest.mark.parametrize("flags", REJECTION_CASES, ids=lambda f: "+".join(f["rollout_rejection"]))
def test_every_rejection_option_metric_verl_logs_is_logged_with_verls_value(flags):
    cfg = CorrectionConfig(**flags, rollout_importance_sampling_sequence_reduction="product")
    old, rollout, mask = anchor_batch(3)
    _, ours = _run_flags(cfg, old, rollout, mask)
    _, _, theirs = _run_verl(cfg, old, rollout, mask)
    assert_every_verl_metric(ours, theirs)
    for option in cfg.rollout_rejection:
        per_option = [k for k in theirs if k.startswith(f"rollout_corr/rollout_rs_{option}_")]
        assert len(per_option) >= 14, per_option  # mean ... seq_masked_fraction (seq_fraction_low: K1 only)


def _presets():
    return sorted(name for name, value in vars(RolloutCorrectionConfig).items() if isinstance(value, classmethod))


@pytest.mark.parametrize("preset", _presets())
@pytest.mark.parametrize("normalize", [False, True])
def test_verls_own_keys_give_verls_weights_mask_and_metrics(preset, normalize):
    """Each preset verl ships, by verl's own keys, through the adapter: what verl's own correction returns."""
    rc = getattr(RolloutCorrectionConfig, preset)()
    old, rollout, mask = anchor_batch(2)
    keys = dict(rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
                rollout_is_batch_normalize=normalize, rollout_rs=rc.rollout_rs,
                rollout_rs_threshold=rc.rollout_rs_threshold)
    w_theirs, m_theirs, theirs = _verls(old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, **keys)
    w_ours, m_ours, ours = verl_keys.rollout_correction_and_rejection_mask(old, rollout, mask, **keys)
    assert (w_ours is None) == (w_theirs is None)
    if w_ours is not None:
        torch.testing.assert_close(w_ours.batch["rollout_is_weights"], w_theirs.batch["rollout_is_weights"],
                                   atol=TOL, rtol=TOL)
    torch.testing.assert_close(m_ours, m_theirs, atol=0, rtol=0)
    assert_every_verl_metric(ours, theirs)
    if normalize and rc.rollout_is is not None:
        assert "rollout_corr/rollout_is_batch_norm_factor" in ours


def test_offpolicy_metrics_without_rollout_logprobs_are_verls():
    """verl returns the trainer's perplexities without rollout logprobs; our core refuses a correction there, the
    adapter answers with the perplexities alone."""
    old, _, mask = anchor_batch(6)
    theirs = helper.compute_offpolicy_metrics(old_log_prob=old, rollout_log_prob=None, response_mask=mask)
    ours = verl_keys.offpolicy_metrics(old, None, mask)
    assert set(theirs) == {"training_ppl", "training_log_ppl"} <= set(ours)
    assert_every_verl_metric(ours, theirs)


@pytest.mark.parametrize("level, threshold, lower", [("token", 2.0, None), ("token", 5.0, 0.5), ("sequence", 3.0, None)])
def test_is_metrics_on_weights_computed_elsewhere_are_verls(level, threshold, lower):
    old, rollout, mask = anchor_batch(8, spread=0.4)
    log_ratio = (old - rollout) * mask
    if level == "sequence":
        for_metrics = log_ratio.sum(-1, keepdim=True)
        raw = for_metrics.clamp(-20, 20).exp().expand_as(old) * mask
    else:
        for_metrics, raw = log_ratio, log_ratio.clamp(-20, 20).exp() * mask
    weights = raw.clamp(max=threshold) if lower is None else torch.where((raw >= lower) & (raw <= threshold), raw, 0)
    args = dict(rollout_is_weights=weights, raw_rollout_is_weights=raw, log_ratio_for_metrics=for_metrics,
                response_mask=mask, rollout_is=level, rollout_is_threshold=threshold, rollout_is_threshold_lower=lower)
    assert_every_verl_metric(verl_keys.is_metrics(**args), helper.compute_is_metrics(**args))


@pytest.mark.parametrize("name", ["verl_decoupled_token_is", "sequence_truncate_product", "token_mask_icepop"])
def test_driver_hook_takes_verls_batch_normalize_key(name):
    """``algorithm.rollout_correction.rollout_is_batch_normalize=true`` beside our flags: verl's self-normalised
    weights and its factor, from our driver hook."""
    cfg = IS_CASES[name]
    old, rollout, mask = anchor_batch(9)

    def batch():
        return DataProto.from_dict(tensors={"old_log_probs": old.clone(), "rollout_log_probs": rollout.clone(),
                                            "response_mask": mask.clone()})

    original = getattr(helper.compute_rollout_correction_and_add_to_batch, "__wrapped__",
                       helper.compute_rollout_correction_and_add_to_batch)
    theirs, their_metrics = original(batch(), {**verl_equivalent(cfg), "rollout_is_batch_normalize": True})
    adapter.set_active_config(cfg)
    try:
        ours, metrics = helper.compute_rollout_correction_and_add_to_batch(
            batch(), {"rollout_is": None, "rollout_rs": None, "bypass_mode": False, "rollout_is_batch_normalize": True})
    finally:
        adapter.set_active_config(None)
    torch.testing.assert_close(ours.batch["rollout_is_weights"], theirs.batch["rollout_is_weights"],
                               atol=TOL, rtol=TOL)
    assert their_metrics["rollout_corr/rollout_is_batch_norm_factor"] != pytest.approx(1.0)
    geometric = cfg.rollout_importance_sampling_sequence_reduction != "product"
    assert_every_verl_metric(metrics, their_metrics, missing_ok={"rollout_corr/chi2_seq"} if geometric else ())


def _actor_config(loss_type: str, keys: dict):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    rc = RolloutCorrectionConfig(loss_type=loss_type, bypass_mode=True, rollout_rs=None, **keys)
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, clip_ratio=0.2,
                       policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc))


@pytest.mark.parametrize("loss_type, keys", [
    ("reinforce", dict(rollout_is="token", rollout_is_threshold=2.0)),
    ("reinforce", dict(rollout_is="sequence", rollout_is_threshold=3.0)),
    ("reinforce", dict(rollout_is="token", rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True)),
    ("reinforce", dict(rollout_is=None)),
    ("ppo_clip", dict(rollout_is="token", rollout_is_threshold=2.0)),
    ("ppo_clip", dict(rollout_is=None)),
])
def test_verls_bypass_loss_runs_with_our_correction_inside(loss_type, keys):
    """``loss_mode=bypass_mode`` with ``old_logprob_source=bypass``: verl's own bypass loss (its ``loss_type``) with
    the core's correction inside it; the loss, its gradient and its metrics equal verl's own bypass loss."""
    cfg = CorrectionConfig(old_logprob_source="bypass", log_rollout_offpolicy_metrics=True)
    _, rollout, mask = anchor_batch(4)
    current = (rollout + 0.3 * torch.randn_like(rollout)).requires_grad_()
    advantages = torch.randn(rollout.shape[0], 1).expand_as(rollout).contiguous()
    config = _actor_config(loss_type, keys)
    verls_own = getattr(core_algos.POLICY_LOSS_REGISTRY["bypass_mode"], "__wrapped__",
                        core_algos.POLICY_LOSS_REGISTRY["bypass_mode"])
    theirs, their_metrics = verls_own(old_log_prob=rollout, log_prob=current, advantages=advantages,
                                      response_mask=mask, loss_agg_mode="token-mean", config=config)
    (their_grad,) = torch.autograd.grad(theirs, current)
    calls = []
    adapter.set_active_config(cfg)
    try:
        loss_fn = core_algos.get_policy_loss_fn("bypass_mode")  # the adapter's wrapper around verl's
        spy = helper.compute_rollout_correction_and_rejection_mask
        helper.compute_rollout_correction_and_rejection_mask = lambda *a, **k: calls.append(1) or spy(*a, **k)
        try:
            ours, our_metrics = loss_fn(old_log_prob=rollout, log_prob=current, advantages=advantages,
                                        response_mask=mask, loss_agg_mode="token-mean", config=config)
        finally:
            helper.compute_rollout_correction_and_rejection_mask = spy
        (our_grad,) = torch.autograd.grad(ours, current)
    finally:
        adapter.set_active_config(None)
    assert calls, "verl's bypass loss did not reach the correction"
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(our_grad, their_grad, atol=1e-6, rtol=1e-6)
    assert_every_verl_metric(our_metrics, their_metrics)


def test_bypass_loss_mode_at_start():
    """Accepted with ``old_logprob_source=bypass``; refused by name where it contradicts the flags."""
    from integration_tests.support.verl_configs import compose_verl

    bypass = "+rollout_parity.old_logprob_source=bypass"
    ok = compose_verl(bypass, "+rollout_parity.rollout_rejection=[seq_sum_k3]",
                      "+rollout_parity.rollout_rejection_threshold=0.01",
                      "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
                      "+actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type=reinforce")
    try:
        assert adapter.configure_verl(ok) is not None
        assert ok.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"
    finally:
        adapter.set_active_config(None)
    for overrides, match in [
        (("+rollout_parity.rollout_importance_sampling_mode=token_truncate",), "old_logprob_source=bypass"),
        ((bypass, "+actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs=seq_sum_k3"), "rollout_rs"),
        ((bypass, "+actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type=pg"), "loss_type"),
    ]:
        config = compose_verl(*overrides, "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode")
        with pytest.raises(ValueError, match=match):
            adapter.configure_verl(config)


@pytest.mark.parametrize("kind, args", [
    ("weights", dict(rollout_is="token", rollout_is_threshold=2.0)),
    ("weights", dict(rollout_is="token", rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True)),
    ("weights", dict(rollout_is="sequence", rollout_is_threshold="0.3_3.0", rollout_is_batch_normalize=True)),
    ("rejection", dict(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.8_1.2,0.05")),
    ("rejection", dict(rollout_rs="seq_sum_k2", rollout_rs_threshold=0.1)),
])
def test_weights_and_rejection_entry_points_on_a_log_ratio_are_verls(kind, args):
    """verl's ``compute_rollout_correction_weights`` / ``compute_rollout_rejection_mask`` and the adapter's answers."""
    old, rollout, mask = anchor_batch(3)
    log_ratio = old - rollout
    if kind == "weights":
        theirs, ours = (helper.compute_rollout_correction_weights(log_ratio, mask, **args),
                        verl_keys.rollout_correction_weights(log_ratio, mask, **args))
        torch.testing.assert_close(ours[0], theirs[0], atol=TOL, rtol=TOL)
    else:
        theirs, ours = (helper.compute_rollout_rejection_mask(log_ratio, mask, **args),
                        verl_keys.rollout_rejection_mask(log_ratio, mask, **args))
        torch.testing.assert_close(ours[0], theirs[0], atol=0, rtol=0)
    assert set(ours[1]) == set(theirs[1])
    assert_every_verl_metric(ours[1], theirs[1])


def test_bypass_loss_on_a_micro_batch_the_driver_rejected_whole_is_zero():
    """verl's own correction refuses an all-masked micro-batch; under the flags the driver may reject one whole, and
    verl's bypass loss with ours inside gives the neutral zero loss that still backpropagates."""
    cfg = CorrectionConfig(old_logprob_source="bypass", rollout_rejection=["seq_sum_k3"], rollout_rejection_threshold=0.01)
    _, rollout, mask = anchor_batch(4)
    current = (rollout + 0.3 * torch.randn_like(rollout)).requires_grad_()
    config = _actor_config("reinforce", dict(rollout_is="token", rollout_is_threshold=2.0))
    adapter.set_active_config(cfg)
    try:
        loss, _ = core_algos.get_policy_loss_fn("bypass_mode")(
            old_log_prob=rollout, log_prob=current, advantages=torch.ones_like(rollout),
            response_mask=torch.zeros_like(mask), loss_agg_mode="token-mean", config=config)
    finally:
        adapter.set_active_config(None)
    assert loss.item() == 0.0
    loss.backward()
    assert current.grad is not None and torch.isfinite(current.grad).all()


def _verl_0_8_seq_fractions(weights, mask, upper, lower):
    """verl 0.8.0's ``compute_is_metrics`` (``rollout_corr_helper.py`` there), re-implemented: each sequence's
    mean APPLIED weight against the bounds (``lower`` defaults to ``1/upper``)."""
    rows = [float((weights[i] * mask[i]).sum() / mask[i].sum()) for i in range(mask.shape[0]) if mask[i].sum() > 0]
    lo = 1.0 / upper if lower is None else lower
    return (sum(r > upper for r in rows) / len(rows), sum(r < lo for r in rows) / len(rows))


@pytest.mark.parametrize("rollout_is, threshold, upper, lower", [
    ("token", 1.2, 1.2, None), ("token", "0.8_1.2", 1.2, 0.8), ("sequence", 1.5, 1.5, None)])
def test_under_verl_0_8_verls_seq_fractions_are_its_applied_weight_shares(monkeypatch, rollout_is, threshold, upper,
                                                                         lower):
    """verl < 0.9.0 reads ``rollout_is_seq_fraction_high``/``_low`` from the applied weights (its high share is 0
    under every bound it applies); the adapter gives that release's values under verl's names, ours (the raw mean,
    verl 0.9's formula) under our names. The compat leg checks the same against verl 0.8.0's own code."""
    from rollout_parity.adapters.verl import compat

    old, rollout, mask = anchor_batch(5, spread=0.6)
    keys = dict(rollout_is=rollout_is, rollout_is_threshold=threshold)
    monkeypatch.setattr(compat, "seq_fractions_of_raw_weights", lambda: True)  # verl >= 0.9.0, whichever is here
    newer = verl_keys.rollout_correction_and_rejection_mask(old, rollout, mask, **keys)[2]
    monkeypatch.setattr(compat, "seq_fractions_of_raw_weights", lambda: False)
    proto, _, ours = verl_keys.rollout_correction_and_rejection_mask(old, rollout, mask, **keys)
    high, low = _verl_0_8_seq_fractions(proto.batch["rollout_is_weights"], mask, upper, lower)
    assert high == 0.0 < newer["rollout_corr/rollout_is_seq_fraction_high"]  # the two formulas differ here
    assert ours["rollout_corr/rollout_is_seq_fraction_high"] == high
    assert ours["rollout_corr/rollout_is_seq_fraction_low"] == pytest.approx(low, abs=1e-12)
    for leaf in ("high", "low"):
        assert ours[f"rollout_correction/is_seq_fraction_{leaf}"] == \
            newer[f"rollout_corr/rollout_is_seq_fraction_{leaf}"]
    # compute_is_metrics on weights computed elsewhere: the same rule
    if rollout_is == "token" and lower is None:
        log_ratio = (old - rollout) * mask
        raw = log_ratio.exp() * mask
        weights = raw.clamp(max=upper)
        got = verl_keys.is_metrics(weights, raw, log_ratio, mask, rollout_is, upper)
        assert (got["rollout_is_seq_fraction_high"], got["rollout_is_seq_fraction_low"]) == pytest.approx(
            _verl_0_8_seq_fractions(weights, mask, upper, None), abs=1e-12)
