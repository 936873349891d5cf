"""Sampler-aware token logprobs: what vLLM's ``processed_logprobs`` returns, on the trainer.

Why (the log(S) bias, verl#6240, trl#6789; ../shared/seeds/pipelinerl-vllm-v1-parity.txt).
With temperature T, vLLM samples token y from the *processed* distribution

    q(y) = softmax(z / T)_y / S   for y in K,   q(y) = 0 outside K,
    S    = sum_{k in K} softmax(z / T)_k            (the surviving mass, 0 < S <= 1)

where K is the set kept by min-p, top-k and top-p.  ``logprobs_mode=processed_logprobs``
returns log q(y) = log p_T(y) - log S.  A trainer that recomputes pi_old with a plain
full-vocabulary log-softmax gets log p_T(y) instead, so every token's log-ratio
old - rollout carries -log S >= 0 of pure bias: the importance weights sit systematically
below 1 (or, with raw logprobs on the rollout side and temperature on the trainer's, the
other way round), the ratio is never centred at 1 even with bit-identical weights, and
truncation / rejection thresholds act on the bias rather than on the mismatch.  Applying
the sampler's own processing on the trainer removes the log S term exactly.

What is matched (vLLM 0.31.0, ``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``,
``logits_processor/builtin.py``), in vLLM's order and with vLLM's float32 operations:

1. logits -> float32.
2. temperature < 1e-5 is greedy: vLLM resets top-k/top-p/min-p for such a request
   (``SamplingParams``) and returns ``log_softmax(logits)`` without temperature.
3. ``logits / T`` (T as a float32 tensor, as vLLM stores it).
4. min-p (an argmax-invariant logits processor, so after temperature, before top-k/top-p):
   p = softmax(logits); tokens with p < max(p) * min_p get -inf.
5. top-k then top-p (``apply_top_k_top_p_pytorch``; top-k alone uses ``apply_top_k_only``):
   top-k keeps every logit >= the k-th largest, so ties at the boundary are *all kept*;
   top-p sorts ascending, renormalises the survivors of top-k with a softmax, takes the
   float32 cumulative sum and drops positions whose cumsum <= 1 - p, always keeping the
   largest.  Among equal logits straddling the top-p boundary the ones dropped are those
   torch's (unstable) sort puts first; we call the very same ``sort`` so the choice is the
   same as vLLM's on the same device and inputs.
6. ``log_softmax`` over the survivors, gathered at the sampled token.

Not modelled: penalties (repetition/frequency/presence), logit bias, bad words, allowed
token ids, min_tokens (set them off for RL rollouts, or apply them to ``logits`` first).
Two batch-level effects of vLLM are documented rather than modelled: a request with
top_p == 1 sharing a batch with a top_p < 1 request also loses tokens whose float32
probability underflows to exactly 0; and vLLM's Triton top-k kernel (GPU) keeps exactly k
of a tied group where the PyTorch path used on CPU (and matched here) keeps all ties.

A sampled token outside the trainer's kept set (possible when trainer and engine logits
differ at the boundary) has log q = -inf.  It is never silent: the count is returned
with ``return_outside=True`` (a :class:`SamplerLogprobs`), otherwise a
:class:`SamplerSupportWarning` names it.  The core treats -inf as maximal mismatch and
counts it in ``rollout_correction/nonfinite_frac``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .distributed import all_reduce
from .ratios import check_shapes

__all__ = [
    "HeadLogprobs", "SamplerLogprobs", "SamplerSettings", "SamplerSupportWarning", "kept_mass_metrics",
    "processed_logits", "rollout_on_full_vocabulary", "sampler_logprobs", "sampler_logprobs_from_hidden",
]

# vLLM's threshold below which a temperature means greedy sampling (sampling_params.py).
_SAMPLING_EPS = 1e-5


class SamplerSupportWarning(RuntimeWarning):
    """Sampled tokens fell outside the trainer's kept set (their logprob is -inf)."""


@dataclass(frozen=True)
class SamplerLogprobs:
    """Result of ``sampler_logprobs(..., return_outside=True)``.

    logprobs:     (B, T) float32 processed logprobs; -inf where the token is outside the kept set.
    outside_mask: (B, T) bool, True where the token is outside the kept set (and inside
                  ``response_mask`` when one was given).
    num_outside:  number of True entries in ``outside_mask``.
    """

    logprobs: torch.Tensor
    outside_mask: torch.Tensor
    num_outside: int


def _check_params(temperature: float, top_k: int | None, top_p: float, min_p: float) -> None:
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a float >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise ValueError(f"top_k must be None, -1 or 0 (disabled), or an int >= 1, got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(min_p, (int, float)) or not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")


@dataclass(frozen=True)
class SamplerSettings:
    """The rollout's sampling parameters that shape vLLM's processed logprobs (one per run).

    ``top_k`` of None, 0 or -1 is off (stored as None), as in vLLM and every framework we adapt.
    Validated at construction with the rules of :func:`sampler_logprobs`.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        top_k = None if self.top_k is None or int(self.top_k) <= 0 else int(self.top_k)
        object.__setattr__(self, "top_k", top_k)
        for name in ("temperature", "top_p", "min_p"):
            object.__setattr__(self, name, float(getattr(self, name)))
        _check_params(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def truncates(self) -> bool:
        """True when vLLM renormalises over a kept set (processed != full-vocabulary logprobs)."""
        return self.top_k is not None or self.top_p < 1.0 or self.min_p > 0.0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}


def processed_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """(R, V) logits -> (R, V) float32 logits after vLLM's temperature, min-p, top-k, top-p.

    Filtered entries are -inf; ``log_softmax`` of the result is vLLM's processed logprobs.
    Out-of-place throughout, so it is differentiable and never modifies ``logits``.
    """
    _check_params(temperature, top_k, top_p, min_p)
    if logits.dim() != 2:
        raise ValueError(f"logits must be (rows, vocab), got shape {tuple(logits.shape)}")
    x = logits.to(torch.float32)
    if temperature < _SAMPLING_EPS:
        return x  # greedy: vLLM drops temperature and every filter for this request
    rows, vocab = x.shape
    temp = torch.full((rows,), float(temperature), dtype=torch.float32, device=x.device)
    x = x.div(temp.unsqueeze(1))

    if min_p > 0.0:
        probs = torch.nn.functional.softmax(x, dim=-1)
        min_p_t = torch.full((rows, 1), float(min_p), dtype=torch.float32, device=x.device)
        threshold = probs.amax(dim=-1, keepdim=True).mul(min_p_t)
        x = x.masked_fill(probs < threshold, float("-inf"))

    use_k = top_k is not None and 0 < top_k < vocab  # vLLM maps 0, -1 and >= V to "off"
    use_p = top_p < 1.0
    if use_p:
        x_sort, x_idx = x.sort(dim=-1, descending=False)
        if use_k:
            kth = x_sort[:, vocab - top_k].unsqueeze(1)
            x_sort = x_sort.masked_fill(x_sort < kth, float("-inf"))
        p_t = torch.full((rows,), float(top_p), dtype=torch.float32, device=x.device)
        cum = x_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p_t.unsqueeze(dim=1)
        drop[:, -1] = False  # the largest always survives
        x_sort = x_sort.masked_fill(drop, float("-inf"))
        x = x.scatter(dim=-1, index=x_idx, src=x_sort)
    elif use_k:
        kth = x.topk(top_k, dim=1).values[:, top_k - 1 : top_k]
        x = x.masked_fill(x < kth, float("-inf"))
    return x


def _token_indices(
    token_ids: torch.Tensor, response_mask: torch.Tensor | None, chunk_size: int, vocab: int,
    device: torch.device, vocab_source: str,
) -> torch.Tensor:
    """Validate the tokens, the mask and the chunk size; the flat long token indices on ``device``."""
    if response_mask is not None and tuple(response_mask.shape) != tuple(token_ids.shape):
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} must equal token_ids shape "
            f"{tuple(token_ids.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    ids = token_ids.reshape(-1).to(device=device, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"token_ids must lie in [0, {vocab}) ({vocab_source}), "
            f"got range [{int(ids.min())}, {int(ids.max())}]"
        )
    return ids


def _outside_kept_set(processed: torch.Tensor, response_mask: torch.Tensor | None) -> torch.Tensor:
    """True where a sampled token got -inf (outside the kept set), inside ``response_mask``."""
    outside = torch.isneginf(processed.detach())
    if response_mask is not None:
        outside = outside & response_mask.to(device=outside.device).bool()
    return outside


def sampler_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
    *,
    response_mask: torch.Tensor | None = None,
    return_outside: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor | SamplerLogprobs:
    """Token logprobs under vLLM's processed sampling distribution (see the module docstring).

    Args:
        logits: (B, T, V) or (N, V) logits that produced each position's token (any float dtype).
        token_ids: (B, T) or (N,) the sampled tokens; ``logits.shape[:-1]`` must equal its shape.
        temperature, top_k, top_p, min_p: the rollout's ``SamplingParams``.  ``top_k`` None,
            -1 or 0 disables top-k (as in vLLM); temperature < 1e-5 means greedy.
        response_mask: optional (B, T) mask; only positions inside it count as outside.
        return_outside: return a :class:`SamplerLogprobs` (logprobs, outside_mask, num_outside)
            instead of the bare tensor.  Without it, tokens outside the kept set raise a
            :class:`SamplerSupportWarning` with their count.
        chunk_size: rows processed at once (each row is independent, so results do not depend
            on it; it bounds the (rows, V) temporaries of the sort).

    Returns:
        (B, T) float32 logprobs (differentiable w.r.t. ``logits``), -inf outside the kept set;
        or a :class:`SamplerLogprobs` when ``return_outside=True``.
    """
    _check_params(temperature, top_k, top_p, min_p)
    if logits.dim() < 2 or tuple(logits.shape[:-1]) != tuple(token_ids.shape):
        raise ValueError(
            "logits must be token_ids.shape + (vocab,): got logits "
            f"{tuple(logits.shape)} and token_ids {tuple(token_ids.shape)}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    vocab = logits.shape[-1]
    ids = _token_indices(token_ids, response_mask, chunk_size, vocab, logits.device,
                         f"vocab of logits {tuple(logits.shape)}")

    flat = logits.reshape(-1, vocab)
    pieces = []
    for start in range(0, flat.shape[0], chunk_size):
        x = processed_logits(flat[start : start + chunk_size], temperature, top_k, top_p, min_p)
        lp = x.log_softmax(dim=-1, dtype=torch.float32)
        pieces.append(lp.gather(-1, ids[start : start + chunk_size].unsqueeze(-1)).squeeze(-1))
    out = (torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=torch.float32)).reshape(
        token_ids.shape
    )

    outside = _outside_kept_set(out, response_mask)
    num_outside = int(outside.sum())
    if return_outside:
        return SamplerLogprobs(logprobs=out, outside_mask=outside, num_outside=num_outside)
    if num_outside:
        warnings.warn(
            f"sampler_logprobs: {num_outside} of {outside.numel()} sampled tokens lie outside the "
            "kept set (temperature/min-p/top-k/top-p) and get logprob -inf; pass "
            "return_outside=True to receive the mask and count",
            SamplerSupportWarning,
            stacklevel=2,
        )
    return out


@dataclass(frozen=True)
class HeadLogprobs:
    """Result of :func:`sampler_logprobs_from_hidden`: both views of the same tokens.

    full:         (...) float32 ``log softmax(z / T)`` over the whole vocabulary (what the
                  trainer's PPO ratio uses).
    processed:    (...) float32 vLLM's processed logprobs (renormalised over the kept set,
                  -inf outside it): what ``r_corr`` must compare with the sampler's logprobs.
    outside_mask: (...) bool, True where the token lies outside the kept set (inside
                  ``response_mask`` when one was given).
    num_outside:  number of True entries in ``outside_mask``.
    """

    full: torch.Tensor
    processed: torch.Tensor
    outside_mask: torch.Tensor
    num_outside: int


@torch.no_grad()
def sampler_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
    *,
    bias: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> HeadLogprobs:
    """Full-vocabulary and sampler-aware logprobs from the final hidden states, chunk by chunk.

    For recomputing pi_old without ever holding (N, V) logits: each chunk of ``chunk_size``
    rows is projected through the head in float32 (``hidden.float() @ weight.float().T``, the
    fp32 lm_head of the parity recipe), and both ``log_softmax(z / T)`` and vLLM's processed
    logprobs (:func:`processed_logits`, the module docstring) are gathered at the sampled
    token. Peak extra memory is a few ``(chunk_size, V)`` float32 buffers. No gradient: pi_old
    is a constant of the loss.

    Args:
        hidden: (..., H) final hidden states at the positions that predict ``token_ids``.
        weight: (V, H) the lm_head weight (any float dtype; projected in float32).
        token_ids: (...) the sampled tokens, ``hidden.shape[:-1]``.
        temperature, top_k, top_p, min_p: the rollout's ``SamplingParams`` (as in
            :func:`sampler_logprobs`).
        bias: optional (V,) head bias.
        response_mask: optional (...) mask; only positions inside it count as outside.
        chunk_size: rows projected at once.
    """
    _check_params(temperature, top_k, top_p, min_p)
    if hidden.dim() < 1 or tuple(hidden.shape[:-1]) != tuple(token_ids.shape):
        raise ValueError(
            "hidden must be token_ids.shape + (hidden_size,): got hidden "
            f"{tuple(hidden.shape)} and token_ids {tuple(token_ids.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, {hidden.shape[-1]}), got {tuple(weight.shape)}")
    ids = _token_indices(token_ids, response_mask, chunk_size, weight.shape[0], hidden.device,
                         f"rows of weight {tuple(weight.shape)}")

    flat = hidden.reshape(-1, hidden.shape[-1])
    w = weight.to(torch.float32)
    b = None if bias is None else bias.to(torch.float32)
    greedy = temperature < _SAMPLING_EPS
    full = torch.empty(flat.shape[0], dtype=torch.float32, device=hidden.device)
    processed = torch.empty_like(full)
    # Under a trainer's bf16 autocast the projection would silently run in bf16.
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        for start in range(0, flat.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z = torch.nn.functional.linear(flat[rows].to(torch.float32), w, b)
            idx = ids[rows].unsqueeze(-1)
            scaled = z if greedy else z / temperature
            full[rows] = scaled.log_softmax(dim=-1).gather(-1, idx).squeeze(-1)
            x = processed_logits(z, temperature, top_k, top_p, min_p)
            processed[rows] = x.log_softmax(dim=-1).gather(-1, idx).squeeze(-1)
    shape = token_ids.shape
    full, processed = full.reshape(shape), processed.reshape(shape)
    outside = _outside_kept_set(processed, response_mask)
    return HeadLogprobs(full=full, processed=processed, outside_mask=outside, num_outside=int(outside.sum()))


def kept_mass_metrics(log_kept_mass: torch.Tensor, response_mask: torch.Tensor,
                      process_group=None) -> dict[str, float]:
    """What sampler-aware pi_old removed from r_corr, and where it could not compare.

    ``log_kept_mass`` is ``log p_T(y) - log q(y)`` per token (full minus processed logprobs):
    log S inside the trainer's kept set, +inf for a sampled token outside it. Returns, over
    the valid tokens of ``response_mask`` (all-reduced over ``process_group`` when given):

    * ``rollout_correction/sampler_log_kept_mass``: mean log S over the valid tokens inside the
      kept set, the bias a full-vocabulary pi_old would have put into every log r_corr;
    * ``rollout_correction/sampler_outside_kept_frac``: the share of valid tokens the engine
      sampled outside the trainer's kept set (trainer and engine logits on different sides of
      the boundary). The core counts those in ``nonfinite_frac`` as maximal mismatch; this
      names the cause, so a boundary token is not mistaken for a NaN from the engine.

    A NaN (non-finite inputs, counted by the core) is in neither.
    """
    check_shapes("response_mask", response_mask, log_kept_mass=log_kept_mass)
    valid = response_mask.detach() != 0
    log_s = log_kept_mass.detach().to(torch.float64)
    inside = valid & torch.isfinite(log_s)
    outside = valid & torch.isposinf(log_s)
    sums = torch.stack([torch.where(inside, log_s, 0.0).sum(), inside.sum().to(torch.float64),
                        outside.sum().to(torch.float64), valid.sum().to(torch.float64)])
    total, n_inside, n_outside, n_valid = all_reduce(sums, process_group).tolist()
    return {"rollout_correction/sampler_log_kept_mass": total / n_inside if n_inside else 0.0,
            "rollout_correction/sampler_outside_kept_frac": n_outside / n_valid if n_valid else 0.0}


def rollout_on_full_vocabulary(rollout_logprobs: torch.Tensor, full_old: torch.Tensor,
                               processed_old: torch.Tensor) -> torch.Tensor:
    """pi_rollout on the trainer's full-vocabulary support: ``log q + log S``, for bypass.

    Under ``old_logprob_source=bypass`` the PPO ratio is pi_theta / pi_rollout. With a truncating
    sampler the engine's processed log q = log p_T - log S is renormalised over the kept set while
    the trainer's pi_theta is a full-vocabulary log-softmax, so the ratio would carry log S, a bias
    of one sign (verl#6240). Adding the trainer's log S (``full_old - processed_old``, measured at
    the same weights) puts pi_rollout back on the trainer's support; at parity the ratio is then 1.
    Where the trainer's kept set misses the token (log S = +inf) or the engine's value is not
    finite, the trainer's own ``full_old`` stands in (a neutral ratio), as DESIGN.md's bad-input
    rules ask; those tokens are counted by :func:`kept_mass_metrics` and ``nonfinite_frac``.
    """
    check_shapes("rollout_logprobs", rollout_logprobs, full_old=full_old, processed_old=processed_old)
    log_s = full_old - processed_old
    moved = rollout_logprobs + log_s.to(rollout_logprobs.dtype)
    return torch.where(torch.isfinite(moved), moved, full_old.to(rollout_logprobs.dtype))
