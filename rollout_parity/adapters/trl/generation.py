"""The hand-over: ``compute_correction`` once per TRL generation batch, into TRL's own channels.

TRL's ``_generate_and_score_completions`` builds the batch (sampler logprobs, pi_old, masks,
``num_items_in_batch``, its own ``importance_sampling_ratio``) reused for every micro-step of the
window. After it, our weights go into ``importance_sampling_ratio``, rejected tokens out of the
loss-only ``tool_mask`` and ``num_items_in_batch`` (never ``completion_mask``, the attention mask),
and under bypass pi_rollout into ``old_per_token_logps``. With a truncating sampler a hook on TRL's
pi_old forward measures log S from its hidden states (chunked fp32 head), so r_corr compares
processed with processed; under ``rollout_sampling_replay`` over the kept sets the colocated engine
returned with each token. docs/trl_loss.md, "How it meets TRL's loss", and
docs/trl_sampler.md, "Sampling replay".
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

from rollout_parity.framework_api import FrameworkAPIError
from rollout_parity.adapters.trl.refusals import MissingRolloutLogprobsError, refuse_trainer
from rollout_parity.adapters._refusals import describe_flags
from rollout_parity.core.correction import compute_correction
from rollout_parity.core.distributed import all_reduce, masked_summary
from rollout_parity.core.metric_names import trl_names
from rollout_parity.core.ratios import check_shapes
from rollout_parity.core.sampler import kept_mass_metrics, rollout_on_full_vocabulary, sampler_logprobs_from_hidden
from rollout_parity.engines.vllm.outputs import kept_sets as vllm_kept_sets

__all__ = ["KEY", "ORIGINAL", "TRL_SAMPLING_METRICS", "THETA_METRICS", "checked_generate", "observed_forward",
           "corrected_generation", "process_group"]

KEY = "rollout_parity/"  # our per-row tensors in TRL's batch dict (split and shuffled with it)
ORIGINAL = KEY + "trl/"  # TRL's own value of a key we replaced (None: TRL had none)
TRL_SAMPLING_METRICS = tuple(f"sampling/{k}" for k in (
    "sampling_logp_difference/mean", "sampling_logp_difference/max", "importance_sampling_ratio/min",
    "importance_sampling_ratio/mean", "importance_sampling_ratio/max"))
#: Diagnostics that need pi_theta or the advantages: the loss pass-through logs them (diagnostics.py).
THETA_METRICS = tuple(f"rollout_correction/{k}" for k in (
    "loss_contrib_pos", "loss_contrib_neg", "loss_contrib_rollout_pos", "loss_contrib_rollout_neg",
    "off_policy_masked_frac"))


def process_group(trainer: Any) -> Any:
    distributed = trainer.accelerator.num_processes > 1 and torch.distributed.is_initialized()
    return torch.distributed.group.WORLD if distributed else None


def checked_generate(state: Any, original: Any, prompts: list) -> tuple:
    """TRL's ``_generate``, checked before TRL's own ratio code reads its sampler logprobs; under
    ``rollout_sampling_replay`` the colocated engine's sampling masks are kept for the pi_old pass."""
    trainer = original.__self__
    replay = state.config.rollout_sampling_replay
    with _engine_outputs(trainer) if replay else contextlib.nullcontext([]) as outputs:
        result = original(prompts)
    completion_ids, logprobs = result[1], result[4]  # TRL 1.15-1.16: (prompt_ids, completion_ids, tool_mask, ..)
    if logprobs is None:
        raise MissingRolloutLogprobsError(f"{describe_flags(state.config)} needs the sampler's per-token logprobs, "
                                          "but the generator returned none (a rollout_func must return 'logprobs')")
    for ids, lps in zip(completion_ids, logprobs):  # one list per completion, aligned token by token
        if len(ids) != len(lps):
            check_shapes("completion_ids", torch.empty(1, len(ids), device="meta"),
                         sampling_logprobs=torch.empty(1, len(lps), device="meta"))
    if replay:
        masks = [getattr(o, "sampling_mask", None) for request in outputs for o in request.outputs]
        if len(masks) != len(completion_ids):
            raise FrameworkAPIError(f"rollout_sampling_replay: TRL returned {len(completion_ids)} completions for "
                                    f"{len(masks)} engine outputs; tested with TRL >=1.15,<1.17")
        # a set list per completion token, or None (the recomputed kept set with the boundary rule stands in)
        state.sampling_masks = [m if m is not None and len(getattr(m, "token_ids", m)) == len(ids) else None
                                for m, ids in zip(masks, completion_ids)]
    return result


@contextlib.contextmanager
def _engine_outputs(trainer: Any) -> Iterator[list]:
    """The colocated engine's ``RequestOutput`` objects while the block runs: TRL hands them, in its
    completions' order, to its module function ``extract_logprobs`` (patched for the block only)."""
    from trl.generation import vllm_generation

    from rollout_parity.adapters._patching import patched

    seen: list = []

    def keep(original: Any, all_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        seen.extend(all_outputs)
        return original(all_outputs, *args, **kwargs)

    with patched(vllm_generation, "extract_logprobs", keep, dotted="trl.generation.vllm_generation.extract_logprobs"):
        yield seen


def observed_forward(state: Any, original: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """TRL's log-prob forward, observed: log S on its pi_old forward, pi_theta on the loss's forward."""
    first = state.kept_mass is not None and not state.kept_mass  # TRL's first forward of a batch is pi_old's
    with _kept_mass_hook(original.__self__, model, args[2], state) if first else contextlib.nullcontext():
        result = original(model, *args, **kwargs)  # args: input_ids, attention_mask, logits_to_keep, ...
    if state.loss_logps is not None and kwargs.get("compute_entropy"):
        state.loss_logps.append(result[0].detach())
    return result


@contextlib.contextmanager
def _kept_mass_hook(trainer: Any, model: Any, logits_to_keep: int, state: Any) -> Iterator[None]:
    """While TRL's pi_old forward runs, ``log S = log p_T - log q`` per sampled token from its hidden states
    (fp32, chunked, inside TRL's own ZeRO-3 gather of the head), over the engine's kept sets where
    ``rollout_sampling_replay`` brought them, else the recomputed ones with the boundary rule."""
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    base = trainer.accelerator.unwrap_model(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    head = base.get_output_embeddings()
    sampling = state.sampling
    masks = state.sampling_masks

    def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        ids = (kwargs["input_ids"] if "input_ids" in kwargs else args[0])[:, -logits_to_keep:]
        first = sum(part[0].shape[0] for part in state.kept_mass)  # TRL scores the batch's rows in order
        kept_sets = None if masks is None else vllm_kept_sets(masks[first:first + ids.shape[0]],
                                                              width=logits_to_keep)
        with maybe_gather_lm_head_ctx(head.weight, head.bias):
            weight = head.weight.full_tensor() if hasattr(head.weight, "full_tensor") else head.weight  # FSDP2
            lp = sampler_logprobs_from_hidden(output.last_hidden_state[:, -logits_to_keep - 1:-1], weight, ids,
                                              sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                                              bias=head.bias, kept_sets=kept_sets)
        replayed = lp.replayed_mask if lp.replayed_mask is not None else torch.zeros_like(lp.outside_mask)
        state.kept_mass.append((lp.full - lp.processed, lp.outside_mask, replayed))

    handle = base.base_model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _hand_over(output: dict, name: str, value: torch.Tensor, trl_had_it: bool = True) -> None:
    """Put ``value`` into TRL's batch under ``name``, keeping TRL's own value for ``revert``."""
    output.setdefault(ORIGINAL + name, output.get(name) if trl_had_it else None)
    output[name] = value


def per_sequence_weight(cfg: Any) -> bool:
    """Whether ``cfg``'s IS weight is one value per sequence (TRL's ``sequence_*`` modes are)."""
    mode = cfg.rollout_importance_sampling_mode or ""
    return mode == "sequence_truncate" or (mode == "sequence_mask"
                                           and cfg.rollout_importance_sampling_sequence_mask_weight == "sequence")


def _ratio_metrics(cfg: Any, weights: torch.Tensor, kept: torch.Tensor, loss_mask: torch.Tensor,
                   group: Any) -> dict[str, float]:
    """TRL's ``sampling/importance_sampling_ratio/*``, of the weights that act: global min / mean / max over the
    loss's tokens, or over its sequences for a per-sequence weight. TRL's own reading of a sequence-level ratio
    counts every completion, one without loss tokens (log ratio 0) with the weight of a ratio of 1; so do we (a
    sequence our rejection took out of the loss is left out: no weight of it acts)."""
    if per_sequence_weight(cfg):
        empty = ~(loss_mask != 0).any(dim=-1)  # no loss token: TRL's sequence ratio exp(0), clamped or masked
        rows = kept.any(dim=-1) | empty
        first = kept.to(torch.uint8).argmax(dim=-1, keepdim=True)
        alone = cfg.replace(rollout_rejection=None, rollout_rejection_threshold=None,
                            off_policy_sequence_mask_delta=None, log_rollout_offpolicy_metrics=False,
                            compile_correction=False)
        zero = weights.new_zeros(1, 1)  # the core's weight of a ratio of 1 under these flags
        one = compute_correction(alone, old_logprobs=zero, rollout_logprobs=zero, response_mask=zero + 1,
                                 with_metrics=False).weights[0, 0]
        weights = torch.where(empty, one, weights.gather(-1, first).squeeze(-1))
        kept = rows
    summary = masked_summary(weights, kept, group, empty=0.0)  # TRL's value with nothing to describe
    return {"sampling/importance_sampling_ratio/min": summary.min,
            "sampling/importance_sampling_ratio/mean": summary.mean,
            "sampling/importance_sampling_ratio/max": summary.max}


def corrected_generation(state: Any, original: Any, inputs: Any) -> dict:
    """TRL's generation batch, then ``compute_correction`` once, handed over through TRL's channels."""
    trainer, cfg = original.__self__, state.config
    bypass = cfg.old_logprob_source == "bypass"
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    lengths = {k: len(metrics[k]) for k in TRL_SAMPLING_METRICS if k in metrics}
    state.sampling = refuse_trainer(cfg, trainer, state.patches)  # the sampler may change between batches
    state.kept_mass = [] if state.sampling.truncates else None
    state.sampling_masks = None
    try:
        output = original(inputs)
        captured = state.kept_mass
    finally:
        state.kept_mass = state.sampling_masks = None
    if captured == []:
        raise FrameworkAPIError("no hidden states seen in TRL's pi_old forward; tested with TRL >=1.15,<1.17")
    completion_mask, tool_mask = output["completion_mask"], output.get("tool_mask")
    loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    rollout, old = output["sampling_per_token_logps"], output.get("old_per_token_logps")
    if old is None:
        raise FrameworkAPIError("TRL computed no old_per_token_logps; tested with TRL >=1.15,<1.17")
    kept_mass = torch.cat([c[0] for c in captured]) if captured else torch.zeros_like(old)
    check_shapes("old_per_token_logps", old, log_kept_mass=kept_mass)
    kept_mass = torch.where(loss_mask != 0, kept_mass, 0.0)
    # the trainer's pi_old as vLLM's sampler sees it (-inf only for a token missing from the engine's own kept set)
    processed_old = old - kept_mass
    group = process_group(trainer)
    out = compute_correction(cfg.replace(off_policy_sequence_mask_delta=None), old_logprobs=processed_old,
                             rollout_logprobs=rollout, response_mask=loss_mask, process_group=group,
                             current_logprobs=processed_old if bypass else None,  # pi_theta = pi_old at generation
                             with_metrics=cfg.wants_metrics or state.hands_weights(trainer))
    output.update({KEY + "old": processed_old, KEY + "response_mask": loss_mask, KEY + "kept_mass": kept_mass})
    # TRL's sampling/sampling_logp_difference/* carry our delta_abs_* (docs/metrics.md)
    logged = trl_names({k: v for k, v in out.metrics.items() if k not in THETA_METRICS}, cfg)
    if captured:
        logged.update(kept_mass_metrics(kept_mass, loss_mask, group, outside_mask=torch.cat([c[1] for c in captured]),
                                        replayed_mask=torch.cat([c[2] for c in captured]) if cfg.rollout_sampling_replay
                                        else None))
    if state.hands_weights(trainer):
        kept = out.mask != 0
        ratio = torch.where(kept, out.weights, torch.ones_like(out.weights)).to(old.dtype)
        _hand_over(output, "importance_sampling_ratio", ratio,
                   trl_had_it=state.patches.previous(trainer, "vllm_importance_sampling_correction", True))
        if cfg.rollout_rejection is not None:
            _hand_over(output, "tool_mask", kept.to(completion_mask.dtype) * (1 if tool_mask is None else tool_mask))
            removed = all_reduce((loss_mask != 0).sum() - kept.sum(), group)
            _hand_over(output, "num_items_in_batch", output["num_items_in_batch"] - removed)
        if cfg.off_policy_sequence_mask_delta is not None:  # TRL's mask reads pi_behaviour here, as log p_T
            behaviour = rollout + kept_mass
            _hand_over(output, "sampling_per_token_logps", behaviour.masked_fill(~behaviour.isfinite(), math.nan))
        if bypass:  # pi_old := pi_rollout on the trainer's support; an engine NaN / inf takes TRL's pi_old (counted)
            _hand_over(output, "old_per_token_logps", rollout_on_full_vocabulary(rollout, old, processed_old))
        logged.update(_ratio_metrics(cfg, ratio, kept, loss_mask, group))
    for name in TRL_SAMPLING_METRICS:  # where we log one of TRL's sampling/* keys, TRL's own value of this batch goes
        if name in logged and name in metrics:
            del metrics[name][lengths.get(name, 0):]
    for name, value in logged.items():
        metrics[name].append(value)
    return output
