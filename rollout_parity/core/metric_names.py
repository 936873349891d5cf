"""One table of every metric rollout-parity logs: its name, its definition, and the name each framework gives the
same quantity. The adapters read it (:func:`verl_names`, :func:`trl_names`, :func:`nemo_rl_names`) and
docs/metrics.md is rendered from it (:func:`markdown_table`), so code and docs cannot drift apart.

The rule it encodes: a metric takes a framework's name only where the framework computes the same formula
(tested against the framework's own metric code), under the conditions written beside it; otherwise it keeps
its own documented prefix (``rollout_correction/``, ``policy/`` for the core's loss, ``weight_sync/``). No
metric of ours called ``kl`` can be negative: a signed estimate is named for its estimator (``k1_mean``).

Notation of the definitions: t runs over the valid tokens of the response mask, i over the sequences with at
least one; ``log r = log π_old − log π_rollout`` is sanitised (a NaN or +inf logprob is neutral, log r = 0;
a −inf on one side is maximal mismatch) and clamped to ±20; π_old is the trainer's recomputed π_old (π_θ under
``old_logprob_source=bypass``); w are the IS weights the loss applies (r where no IS mode is set).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Optional

#: What adapters, tests and docs read; ``Metric`` and ``Condition`` are the table's parts.
__all__ = ["METRICS", "RENAMED", "metric_for", "verl_expresses_is", "NemoRLLoss", "verl_names", "trl_names", "nemo_rl_names", "markdown_table"]

PREFIX = "rollout_correction/"


class NemoRLLoss(NamedTuple):
    """What decides whether NeMo RL's ``ClippedPGLossFn`` logs one of our quantities itself."""

    kl_type: str  # reference_policy_kl_type: the estimator of its gen_kl_error
    own_truncation: bool  # its truncated importance sampling (tis / icepop / seq-mask-tis) is on
    sequence_level: bool  # sequence_level_importance_ratios


@dataclass(frozen=True)
class Condition:
    """When a framework's formula is ours: ``label`` and ``text`` for the docs, ``holds(cfg, framework)`` for code."""

    label: str
    text: str
    holds: Callable[[Any, Any], bool]


def _is_on(cfg: Any, _: Any = None) -> bool:
    return cfg.rollout_importance_sampling_mode is not None


def _removes_no_token(cfg: Any) -> bool:
    return cfg.rollout_rejection is None and cfg.off_policy_sequence_mask_delta is None


ALWAYS = Condition("", "", lambda cfg, fw: True)
PRODUCT = Condition("product", "`rollout_importance_sampling_sequence_reduction=product`",
                    lambda cfg, fw: cfg.rollout_importance_sampling_sequence_reduction == "product")
IS_ON = Condition("IS", "an IS mode is set", _is_on)
IS_BOUNDED = Condition(
    "IS, bounded w", "an IS mode is set, other than `sequence_mask` with per-token weights (whose w verl would "
    "first clamp to its threshold)",
    lambda cfg, fw: _is_on(cfg) and not (cfg.rollout_importance_sampling_mode == "sequence_mask"
                                         and cfg.rollout_importance_sampling_sequence_mask_weight == "token"))
TIS = Condition("TIS", "`token_truncate` without a lower bound (verl's token TIS)",
                lambda cfg, fw: cfg.rollout_importance_sampling_mode == "token_truncate"
                and cfg.rollout_importance_sampling_threshold_lower is None)
ICEPOP = Condition("IcePop", "`token_mask` with a lower bound (verl's token IcePop)",
                   lambda cfg, fw: cfg.rollout_importance_sampling_mode == "token_mask"
                   and cfg.rollout_importance_sampling_threshold_lower is not None)
REJECTION_ON = Condition("rejection", "`rollout_rejection` is set", lambda cfg, fw: cfg.rollout_rejection is not None)


def verl_expresses_is(cfg: Any) -> bool:
    """verl's own ``rollout_is`` has this IS mode: token TIS, token IcePop (a lower bound > 0), the product
    sequence ratio truncated, or masked with a lower bound and kept sequences weighted by ρ_seq."""
    mode, lower = cfg.rollout_importance_sampling_mode, cfg.rollout_importance_sampling_threshold_lower
    if mode is None:
        return False
    if mode == "token_truncate":
        return lower is None
    if mode == "token_mask":
        return lower is not None and lower > 0
    if cfg.rollout_importance_sampling_sequence_reduction != "product":
        return False
    if mode == "sequence_truncate":
        return lower is None
    return lower is not None and lower > 0 and cfg.rollout_importance_sampling_sequence_mask_weight == "sequence"


VERL_IS = Condition("verl IS", "an IS mode verl's `rollout_is` has: `token_truncate` without a lower bound (TIS), "
                    "`token_mask` with one (IcePop), `sequence_truncate` or `sequence_mask` (lower bound, "
                    "`sequence_mask_weight=sequence`) with `sequence_reduction=product`",
                    lambda cfg, fw: verl_expresses_is(cfg))
VERL_IS_TOKEN = Condition("verl IS, token", "a verl IS mode (above) at token level",
                          lambda cfg, fw: verl_expresses_is(cfg)
                          and cfg.rollout_importance_sampling_mode.startswith("token"))
VERL_IS_SEQ = Condition("verl IS, sequence", "a verl IS mode (above) at sequence level",
                        lambda cfg, fw: verl_expresses_is(cfg)
                        and cfg.rollout_importance_sampling_mode.startswith("sequence"))
VERL_SEQ_ICEPOP = Condition("verl sequence IcePop", "`sequence_mask` as verl has it (a lower bound, "
                            "`sequence_reduction=product`, `sequence_mask_weight=sequence`)",
                            lambda cfg, fw: verl_expresses_is(cfg)
                            and cfg.rollout_importance_sampling_mode == "sequence_mask")

def _nemo_gen_kl(kl_type: str) -> Callable[[Any, Any], bool]:
    return lambda cfg, nemo: (nemo is not None and nemo.kl_type == kl_type and _removes_no_token(cfg)
                              and cfg.old_logprob_source != "bypass")


NEMO_K3 = Condition("k3, same tokens", "its `reference_policy_kl_type: k3` (the default), no rejection or "
                    "off-policy mask, not bypass (its loss then reads our tokens and our π_old)", _nemo_gen_kl("k3"))
NEMO_K1 = Condition("k1, same tokens", "its `reference_policy_kl_type: k1`, no rejection or off-policy mask, "
                    "not bypass", _nemo_gen_kl("k1"))
NEMO_RAW_RATIO = Condition(
    "raw r, same tokens", "no IS mode of ours and no truncation of its own, token-level ratios, no rejection or "
    "off-policy mask, not bypass",
    lambda cfg, nemo: (nemo is not None and not _is_on(cfg) and not nemo.own_truncation and not nemo.sequence_level
                       and _removes_no_token(cfg) and cfg.old_logprob_source != "bypass"))


@dataclass(frozen=True)
class Metric:
    """One metric: our key, its definition, and each framework's key for the same formula (with the condition).

    ``verl``/``trl``/``nemo_rl``: ``(key, Condition)`` pairs, the first that holds wins; verl and TRL log our
    value under that key, NeMo RL logs the quantity itself (its loss computes it), so there ours is left out.
    ``note``: where a framework's metric of a similar name is not the same formula, how it differs.
    """

    name: str
    definition: str
    verl: tuple[tuple[str, Condition], ...] = ()
    trl: tuple[tuple[str, Condition], ...] = ()
    nemo_rl: tuple[tuple[str, Condition], ...] = ()
    note: str = ""
    source: str = "core"  # who logs it: core (compute_correction / policy_loss), sampler, verl, trl, sync

    def key_for(self, framework: str, cfg: Any, settings: Any = None) -> Optional[str]:
        """The framework's key for this metric under ``cfg``, or None where the framework has no same formula."""
        for key, condition in getattr(self, framework):
            if condition.holds(cfg, settings):
                return key
        return None


def _c(leaf: str) -> str:
    return PREFIX + leaf


def _v(leaf: str, condition: Condition = ALWAYS) -> tuple[tuple[str, Condition], ...]:
    return (("rollout_corr/" + leaf, condition),)


#: Every metric, in the order of docs/metrics.md.
METRICS: tuple[Metric, ...] = (
    # ------------------------------------------------ divergence between the trainer's π_old and the sampler's
    Metric(_c("k1_mean"), "mean_t(−log r) = mean_t(log π_rollout − log π_old): the k1 estimate of "
           "KL(π_rollout‖π_old), unbiased but signed (a negative value is noise, not a negative divergence)",
           nemo_rl=(("gen_kl_error", NEMO_K1),),
           note="verl logs this formula as `rollout_corr/kl` and ms-swift as `kl`; our own name never says KL for "
                "it. In verl the adapter logs it under `rollout_corr/kl` too, beside ours, with verl's signed "
                "convention (mean(log π_rollout − log π_old), negative when the trainer is the more confident), "
                "because verl users' dashboards read that name"),
    Metric(_c("k3_kl"), "mean_t(r − 1 − log r) ≥ 0: the k3 estimate of KL(π_rollout‖π_old)",
           verl=_v("k3_kl"), nemo_rl=(("gen_kl_error", NEMO_K3),)),
    Metric(_c("delta_abs_mean"), "mean_t abs(log r) (the paper's δ_t, eq. 1)",
           trl=(("sampling/sampling_logp_difference/mean", ALWAYS),),
           note="TRL's own: a mean of per-rank means, NaN tokens left out, π_old on the full vocabulary; ours: "
                "the global token mean, non-finite tokens by the rules above, π_old on the sampler's support"),
    Metric(_c("delta_abs_max"), "max_t abs(log r)", trl=(("sampling/sampling_logp_difference/max", ALWAYS),),
           note="TRL's own: π_old on the full vocabulary, an inf where one logprob is −inf; ours: ±20 there"),
    Metric(_c("chi2_token"), "mean_t r² − 1", verl=_v("chi2_token")),
    Metric(_c("chi2_seq"), "mean_i ρ_i² − 1 with ρ_i = exp(±20-clamped Σ_t log r) (`product`) or "
           "exp(mean_t log r) (`geometric_mean`, ms-swift's), per `rollout_importance_sampling_sequence_reduction`",
           verl=_v("chi2_seq", PRODUCT)),
    # ------------------------------------------------ perplexities (tokens where both logprobs are finite)
    Metric(_c("training_log_ppl"), "mean_i(−mean_t log π_old)", verl=_v("training_log_ppl")),
    Metric(_c("training_ppl"), "mean_i exp(−mean_t log π_old), in float64", verl=_v("training_ppl")),
    Metric(_c("rollout_log_ppl"), "mean_i(−mean_t log π_rollout)", verl=_v("rollout_log_ppl")),
    Metric(_c("rollout_ppl"), "mean_i exp(−mean_t log π_rollout), in float64", verl=_v("rollout_ppl")),
    Metric(_c("log_ppl_diff"), "mean_i d_i, d_i = mean_t log π_rollout − mean_t log π_old",
           verl=_v("log_ppl_diff")),
    Metric(_c("log_ppl_abs_diff"), "mean_i abs(d_i)", verl=_v("log_ppl_abs_diff")),
    Metric(_c("log_ppl_diff_max"), "max_i d_i", verl=_v("log_ppl_diff_max")),
    Metric(_c("log_ppl_diff_min"), "min_i d_i", verl=_v("log_ppl_diff_min")),
    Metric(_c("ppl_ratio"), "mean_i exp(d_i) (training over rollout perplexity)", verl=_v("ppl_ratio")),
    # ------------------------------------------------ the IS weights
    Metric(_c("is_weight_mean"), "mean_t w", verl=_v("rollout_is_mean", IS_ON),
           nemo_rl=(("sampling_importance_ratio", NEMO_RAW_RATIO),)),
    Metric(_c("ess"), "(Σ_t w)² / (n Σ_t w²): the effective sample size per token, 1 on-policy",
           verl=_v("rollout_is_eff_sample_size", IS_BOUNDED),
           note="verl divides by zero when every weight is 0 (all masked); ours logs 0"),
    Metric(_c("clipped_frac"), "share of valid tokens whose weight the IS mode truncated or zeroed",
           verl=(("rollout_corr/rollout_is_ratio_fraction_high", TIS), ("rollout_corr/rollout_is_oob_ratio", ICEPOP),
                 ("rollout_corr/rollout_is_oob_ratio", VERL_SEQ_ICEPOP)),
           note="the NeMo RL adapter logs `is_oob_ratio` from our bounds while ours acts (NeMo RL's own formula)"),
    # ------------------------------------------------ what the correction removed
    Metric(_c("rejected_token_frac"), "share of valid tokens `rollout_rejection` removed",
           verl=_v("rollout_rs_masked_fraction", REJECTION_ON)),
    Metric(_c("rejected_seq_frac"), "share of sequences with a token `rollout_rejection` removed",
           verl=_v("rollout_rs_seq_masked_fraction", REJECTION_ON),
           note="verl divides by every row, ours by the rows with a valid token: equal without empty rows"),
    Metric(_c("off_policy_masked_frac"), "share of sequences the off-policy sequence mask removed "
           "(mean_t(log π_rollout − log π_θ) > δ and A < 0)"),
    Metric(_c("nonfinite_frac"), "share of valid tokens with a NaN or ±inf among the logprobs the correction "
           "read (π_old, π_rollout, π_θ), each counted once"),
    # ------------------------------------------------ the zero-centred loss contribution C(r) = −(r − 1)A (eq. 5)
    Metric(_c("loss_contrib_pos"), "Σ_t C(π_θ/π_old) over tokens with A > 0, divided by n (tokens where every "
           "logprob is finite)"),
    Metric(_c("loss_contrib_neg"), "the same over tokens with A < 0; the two add up to the token mean of C"),
    Metric(_c("loss_contrib_rollout_pos"), "`loss_contrib_pos` with r = π_θ/π_rollout"),
    Metric(_c("loss_contrib_rollout_neg"), "`loss_contrib_neg` with r = π_θ/π_rollout"),
    # ------------------------------------------------ sampler-aware π_old (top-k / top-p / min-p)
    Metric(_c("sampler_log_kept_mass"), "mean over valid tokens of log S, the log of the kept set's probability "
           "mass each processed logprob was renormalised by", source="sampler"),
    Metric(_c("sampler_outside_kept_frac"), "share of valid tokens the trainer's recomputed kept set missed "
           "(they get the boundary rule)", source="sampler"),
    Metric(_c("sampler_replayed_frac"), "share of valid tokens renormalised over the engine's own kept set "
           "(`rollout_sampling_replay`)", source="sampler"),
    # ------------------------------------------------ the IS weights' spread (``metrics.weight_distribution_metrics``)
    Metric(_c("is_weight_max"), "max_t w", verl=_v("rollout_is_max", VERL_IS_TOKEN), source="distribution"),
    Metric(_c("is_weight_min"), "min_t w", verl=_v("rollout_is_min", VERL_IS_TOKEN), source="distribution"),
    Metric(_c("is_seq_ratio_max"), "sequence modes: max_i ρ_i, the raw sequence ratio before truncation or masking",
           verl=_v("rollout_is_max", VERL_IS_SEQ), source="distribution"),
    Metric(_c("is_seq_ratio_min"), "sequence modes: min_i ρ_i", verl=_v("rollout_is_min", VERL_IS_SEQ),
           source="distribution"),
    Metric(_c("is_weight_std"), "the token std of w (population)", verl=_v("rollout_is_std", VERL_IS),
           source="distribution"),
    Metric(_c("is_ratio_fraction_high"), "share of valid tokens whose raw r exceeds the IS threshold C (sequence "
           "modes: share of sequences with ρ_i > C); under token TIS the same value as `clipped_frac`",
           verl=_v("rollout_is_ratio_fraction_high", VERL_IS),
           source="distribution"),
    Metric(_c("is_ratio_fraction_low"), "the same below the lower bound (1/C without one)",
           verl=_v("rollout_is_ratio_fraction_low", VERL_IS), source="distribution"),
    Metric(_c("is_seq_mean"), "mean_i of w̄_i, each sequence's mean weight", verl=_v("rollout_is_seq_mean", VERL_IS),
           source="distribution"),
    Metric(_c("is_seq_std"), "std_i of w̄_i (unbiased; 0 for one sequence)", verl=_v("rollout_is_seq_std", VERL_IS),
           source="distribution"),
    Metric(_c("is_seq_max"), "max_i w̄_i", verl=_v("rollout_is_seq_max", VERL_IS), source="distribution"),
    Metric(_c("is_seq_min"), "min_i w̄_i", verl=_v("rollout_is_seq_min", VERL_IS), source="distribution"),
    Metric(_c("is_seq_max_deviation"), "max_i abs(w̄_i − 1)", verl=_v("rollout_is_seq_max_deviation", VERL_IS),
           source="distribution"),
    Metric(_c("is_seq_fraction_high"), "share of sequences whose mean raw ratio (before truncation) exceeds C",
           verl=_v("rollout_is_seq_fraction_high", VERL_IS), source="distribution"),
    Metric(_c("is_seq_fraction_low"), "the same below the lower bound (1/C without one)",
           verl=_v("rollout_is_seq_fraction_low", VERL_IS), source="distribution"),
    Metric(_c("is_batch_norm_factor"), "with verl's `rollout_is_batch_normalize`: the mean the weights were divided "
           "by (token mean, or mean over sequences for the sequence modes); the other `is_*` describe the weights "
           "before it", verl=_v("rollout_is_batch_norm_factor", IS_ON), source="verl"),
    # ------------------------------------------------ each rejection rule (``metrics.rejection_rule_metrics``)
    Metric(_c("rejection/{option}/mean"), "the token mean of the rule's statistic S (per token K1 = −log r, K2, K3; "
           "a sequence rule's S counted once per valid token of its sequence)",
           verl=(("rollout_corr/rollout_rs_{option}_mean", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/max"), "max of S over valid tokens (token rules) or sequences (sequence rules)",
           verl=(("rollout_corr/rollout_rs_{option}_max", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/min"), "min of S, the same way",
           verl=(("rollout_corr/rollout_rs_{option}_min", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/std"), "the token std of S clamped to its bounds ([log lo, log hi] for K1, "
           "[0, hi] otherwise)",
           verl=(("rollout_corr/rollout_rs_{option}_std", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/fraction_high"), "share (tokens or sequences, as `max`) with S above its bound "
           "(log hi for K1)",
           verl=(("rollout_corr/rollout_rs_{option}_fraction_high", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/fraction_low"), "K1: the same below log lo; 0 otherwise",
           verl=(("rollout_corr/rollout_rs_{option}_fraction_low", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/seq_mean"), "mean_i S_i over sequences (a token rule's S_i is its sequence mean)",
           verl=(("rollout_corr/rollout_rs_{option}_seq_mean", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/seq_std"), "std_i S_i (unbiased; 0 for one sequence)",
           verl=(("rollout_corr/rollout_rs_{option}_seq_std", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/seq_max"), "max_i S_i",
           verl=(("rollout_corr/rollout_rs_{option}_seq_max", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/seq_min"), "min_i S_i",
           verl=(("rollout_corr/rollout_rs_{option}_seq_min", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/seq_max_deviation"), "max_i abs(S_i)",
           verl=(("rollout_corr/rollout_rs_{option}_seq_max_deviation", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/seq_fraction_high"), "share of sequences with S_i above the upper bound",
           verl=(("rollout_corr/rollout_rs_{option}_seq_fraction_high", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/seq_fraction_low"), "K1 only: share of sequences with S_i below log lo",
           verl=(("rollout_corr/rollout_rs_{option}_seq_fraction_low", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/masked_fraction"), "share of valid tokens this rule alone rejects",
           verl=(("rollout_corr/rollout_rs_{option}_masked_fraction", REJECTION_ON),), source="rejection"),
    Metric(_c("rejection/{option}/seq_masked_fraction"), "share of sequences with a token this rule alone rejects",
           verl=(("rollout_corr/rollout_rs_{option}_seq_masked_fraction", REJECTION_ON),), source="rejection"),
    # ------------------------------------------------ the policy loss
    Metric("policy/pg_clipfrac", "share of loss tokens where the clipped term bound the PPO loss "
           "(`policy_loss`)", verl=(("actor/pg_clipfrac", ALWAYS),), trl=(("clip_ratio/region_mean", ALWAYS),),
           note="verl's and TRL's are their own losses' (we never log them); same formula for the clipped "
                "PPO loss"),
    Metric("policy/pg_clipfrac_lower", "share of loss tokens where dual clip bound the loss (A < 0)",
           verl=(("actor/pg_clipfrac_lower", ALWAYS),)),
    Metric("policy/ppo_k1_mean", "mean over loss tokens of log π_old − log π_θ: the k1 estimate of "
           "KL(π_old‖π_θ), signed", note="verl's loss logs this formula as `actor/ppo_kl`"),
    Metric(_c("ppo_k1_mean"), "`policy/ppo_k1_mean` over the tokens TRL's loss (or a verl loss that logs no "
           "`actor/ppo_kl`) trained on, once per micro-step", source="trl, verl"),
    Metric(_c("loss_nonfinite_frac"), "share of a micro-batch's valid tokens whose π_old or π_θ was NaN or ±inf "
           "as verl's loss read it (neutralised or taken out of the loss)", source="verl"),
    Metric("sampling/importance_sampling_ratio/{min,mean,max}", "TRL's names; while our weights act in TRL's "
           "loss: min / mean / max of those weights over the loss's tokens (for the sequence modes per "
           "completion, one without loss tokens at a ratio of 1, 0 when nothing is in the loss, as TRL counts), "
           "global over ranks", trl=(("sampling/importance_sampling_ratio/{min,mean,max}", ALWAYS),),
           note="TRL's mean is a mean of per-rank means", source="trl"),
    # ------------------------------------------------ the weight-sync check
    Metric("weight_sync/probe_delta_abs_mean", "mean abs(Δ logprob) between engine and trainer on the sync probe",
           source="sync"),
    Metric("weight_sync/probe_delta_abs_trimmed_mean", "the same without the largest gaps (what is checked)",
           source="sync"),
    Metric("weight_sync/probe_delta_abs_max", "max abs(Δ logprob) on the sync probe", source="sync"),
    Metric("weight_sync/check_failed", "1 when the trimmed mean exceeded `weight_sync_check_threshold`",
           source="sync"),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
#: The per-rule names (``{option}`` is a ``rollout_rejection`` option): a regular expression for each.
_PATTERNS: tuple[tuple["re.Pattern[str]", Metric], ...] = tuple(
    (re.compile(re.escape(m.name).replace(re.escape("{option}"), "(?P<option>[a-z0-9_]+)") + "$"), m)
    for m in METRICS if "{option}" in m.name)


def metric_for(key: str) -> tuple[Optional[Metric], dict[str, str]]:
    """The table's entry for a logged key, and the values of its placeholders (``{option}``)."""
    metric = BY_NAME.get(key)
    if metric is not None:
        return metric, {}
    for pattern, metric in _PATTERNS:
        match = pattern.match(key)
        if match:
            return metric, match.groupdict()
    return None, {}

#: Old name -> new name, for dashboards and scripts that read the names before this table.
RENAMED: dict[str, str] = {
    "rollout_correction/kl": "rollout_correction/k1_mean",
    "policy/ppo_kl": "policy/ppo_k1_mean (core `policy_loss`), rollout_correction/ppo_k1_mean (TRL)",
    "actor/policy/ppo_kl": "dropped (verl's own `actor/ppo_kl` is the same value)",
    "actor/policy/nonfinite_frac": "actor/rollout_correction/loss_nonfinite_frac",
}


def _renamed(metrics: Mapping[str, float], framework: str, cfg: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in metrics.items():
        metric, fields = metric_for(key)
        named = metric.key_for(framework, cfg) if metric else None
        out[named.format(**fields) if named else key] = value
    return out


def verl_names(metrics: Mapping[str, float], cfg: Any) -> dict[str, float]:
    """``metrics`` with verl's ``rollout_corr/*`` names where verl computes the same formula under ``cfg``."""
    return _renamed(metrics, "verl", cfg)


def trl_names(metrics: Mapping[str, float], cfg: Any) -> dict[str, float]:
    """``metrics`` with TRL's ``sampling/*`` names where TRL has the same quantity (docs/metrics.md says how)."""
    return _renamed(metrics, "trl", cfg)


def nemo_rl_names(metrics: Mapping[str, float], cfg: Any, nemo: Optional[NemoRLLoss]) -> dict[str, float]:
    """``metrics`` without those NeMo RL's own loss logs itself under ``nemo`` (its ``gen_kl_error``, ...)."""
    return {k: v for k, v in metrics.items() if k not in BY_NAME or BY_NAME[k].key_for("nemo_rl", cfg, nemo) is None}


def _cell(pairs: tuple[tuple[str, Condition], ...]) -> str:
    if not pairs:
        return "—"
    return "<br>".join(f"`{key}`" + (f" ({condition.label})" if condition.label else "") for key, condition in pairs)


def markdown_table() -> str:
    """docs/metrics.md's table, its conditions and its notes (a test checks the docs carry exactly this)."""
    lines = ["| ours | verl | TRL | NeMo RL | definition |", "|---|---|---|---|---|"]
    conditions: dict[str, str] = {}
    for m in METRICS:
        lines.append(f"| `{m.name}` | {_cell(m.verl)} | {_cell(m.trl)} | {_cell(m.nemo_rl)} | {m.definition} |")
        for _, condition in m.verl + m.trl + m.nemo_rl:
            if condition.label:
                conditions.setdefault(condition.label, condition.text)
    lines += ["", "A framework's name in brackets applies when:", ""]
    lines += [_item(f"({label}): {text}") for label, text in conditions.items()]
    lines += ["", "Where a framework's metric of a similar name is not the same formula:", ""]
    lines += [_item(f"`{m.name}`: {m.note}.") for m in METRICS if m.note]
    return "\n".join(lines) + "\n"


def _item(text: str) -> str:
    """A markdown list item, wrapped at 120 characters (docs prose)."""
    return textwrap.fill(text, 120, initial_indent="* ", subsequent_indent="  ", break_on_hyphens=False)
