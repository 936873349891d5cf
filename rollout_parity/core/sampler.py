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
5. top-k then top-p, by the rule of the implementation the engine ran (``engine_topk_topp``):

   * ``"pytorch"``: ``apply_top_k_top_p_pytorch`` (vLLM on CPU; top-k alone uses
     ``apply_top_k_only``): top-k keeps every logit >= the k-th largest, so ties at the boundary
     are *all kept*; top-p sorts ascending, renormalises the survivors of top-k with a softmax,
     takes the float32 cumulative sum and drops positions whose cumsum <= 1 - p, always keeping
     the largest. Among equal logits straddling the top-p edge the ones dropped are those the
     (unstable) sort puts first: we call the same ``torch.sort`` as vLLM, so on the same device
     and inputs the choice is the same.
   * ``"triton"``: ``apply_top_k_top_p_triton`` (``topk_topp_triton.py``; vLLM on a GPU, where
     Triton is present): top-k keeps exactly k, and among the logits tied at the k-th place the
     lowest token ids; top-p keeps the fewest tokens whose mass reaches p, again the lowest ids
     of a tied group at its edge. Computed here by a stable sort that puts the lowest ids last.
     The kernel's own float arithmetic (a pivot search on float32 probabilities) is not
     reproduced: off-tie edges agree up to the float noise the boundary rule absorbs, and at a
     top-p edge inside a tied group the kernel may keep the whole group (its tie match is done
     on logits recomputed through log/exp and can miss), a difference bounded by that group's
     mass (docs/fp32_and_sampler_ties.md, "Ties").
   * ``"auto"`` (default): ``"triton"`` when the pass runs on a CUDA device, ``"pytorch"`` on CPU:
     in every framework adapted here the engine runs on the same kind of device as the trainer.

6. ``log_softmax`` over the survivors, gathered at the sampled token.

Not modelled: penalties (repetition/frequency/presence), logit bias, bad words, allowed
token ids, min_tokens (set them off for RL rollouts, or apply them to ``logits`` first).
A batch-level effect of vLLM's PyTorch path is documented rather than modelled: a request with
top_p == 1 sharing a batch with a top_p < 1 request also loses tokens whose float32
probability underflows to exactly 0.

The boundary rule. A sampled token outside the trainer's *recomputed* kept set (trainer and
engine logits put it on different sides of the nucleus edge, by float noise) cannot be outside
the set the engine sampled from: the engine drew it from there. The trainer's estimate of the
engine's set is therefore ``K ∪ {y}``, the smallest set that contains its own kept set and the
observation: ``log q(y) = log p_T(y) - log(S + p_T(y))``, finite. When the noise flipped only y's
own membership (the usual case) that is exactly the engine's set; a token far outside the nucleus
(a real mismatch) still gets its honest, very negative log-ratio. Such tokens are counted
(``outside_mask``; ``rollout_correction/sampler_outside_kept_frac``), never silent.
``keep_sampled=False`` gives the strict reading (-inf, with a :class:`SamplerSupportWarning`).
Where the engine returns its exact kept set (``kept_sets=``, :mod:`rollout_parity.core.replay`)
the trainer renormalises over exactly that set instead; a sampled token missing from the
engine's own set is an engine failure and stays -inf (the core's maximal mismatch, counted in
``nonfinite_frac``). docs/fp32_and_sampler_logprobs.md, "The boundary rule"; docs/fp32_and_sampler_replay.md,
"Sampling replay".
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .distributed import all_reduce
from .fp32_logprobs import _softmax_rows_
from .head_matmul import HeadProjector, chunk_rows, exact_fp32_matmul
from .kernel_launch import kernels_allowed, launch
from .kept_set import (_limit, _on_candidates, alone_holds_top_p, replayed_log_mass, replayed_log_mass_of,
                       settle_kept_sets)
from .ratios import check_shapes
from .replay import KeptSets

__all__ = [
    "HeadLogprobs", "KeptSets", "SamplerLogprobs", "SamplerSettings", "SamplerSupportWarning", "kept_mass_metrics",
    "processed_logits", "rollout_on_full_vocabulary", "sampler_logprobs", "sampler_logprobs_from_hidden",
    "topk_topp_rule", "ENGINE_TOPK_TOPP",
]

# vLLM's threshold below which a temperature means greedy sampling (sampling_params.py).
_SAMPLING_EPS = 1e-5
#: ``engine_topk_topp`` values: which of vLLM's top-k/top-p implementations the engine ran.
ENGINE_TOPK_TOPP = ("auto", "pytorch", "triton")


def topk_topp_rule(engine_topk_topp: str, device: torch.device | str) -> str:
    """``"pytorch"`` or ``"triton"``: the tie rule of vLLM's top-k/top-p for ``engine_topk_topp`` (``"auto"``: the
    Triton kernel's when the pass runs on a CUDA device, as vLLM's engine does there; the PyTorch rule on CPU)."""
    if engine_topk_topp not in ENGINE_TOPK_TOPP:
        raise ValueError(f"engine_topk_topp must be one of {ENGINE_TOPK_TOPP}, got {engine_topk_topp!r}: 'triton' "
                         "for a vLLM engine on a GPU, 'pytorch' for one on CPU")
    if engine_topk_topp != "auto":
        return engine_topk_topp
    return "triton" if torch.device(device).type == "cuda" else "pytorch"


class SamplerSupportWarning(RuntimeWarning):
    """Sampled tokens fell outside the trainer's kept set (their logprob is -inf)."""


@dataclass(frozen=True)
class SamplerLogprobs:
    """Result of ``sampler_logprobs(..., return_outside=True)``.

    logprobs:     (B, T) float32 processed logprobs (a token the recomputed kept set missed gets
                  the boundary rule, or -inf with ``keep_sampled=False``).
    outside_mask: (B, T) bool, True where the trainer's recomputed kept set missed the sampled
                  token (and inside ``response_mask`` when one was given).
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


def _top_k_on(top_k: int | None, vocab: int) -> int | None:
    """``top_k`` as a filter over ``vocab`` entries, or None where vLLM treats it as off (None, -1, 0, k >= V)."""
    return top_k if top_k is not None and 0 < top_k < vocab else None


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
    *,
    engine_topk_topp: str = "auto",
) -> torch.Tensor:
    """(R, V) logits -> (R, V) float32 logits after vLLM's temperature, min-p, top-k, top-p.

    Filtered entries are -inf; ``log_softmax`` of the result is vLLM's processed logprobs.
    ``engine_topk_topp`` picks the tie rule of top-k/top-p (module docstring, step 5).
    Out-of-place throughout, so it is differentiable and never modifies ``logits``.
    """
    _check_params(temperature, top_k, top_p, min_p)
    triton = topk_topp_rule(engine_topk_topp, logits.device) == "triton"
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
        if triton:
            # ascending, ties by descending id: the lowest ids of a tied group come last, where both filters keep
            x_sort, rev = x.flip(-1).sort(dim=-1, stable=True)
            x_idx = (vocab - 1) - rev
        else:
            x_sort, x_idx = x.sort(dim=-1, descending=False)
        if use_k and triton:
            x_sort = x_sort.masked_fill(torch.arange(vocab, device=x.device) < vocab - top_k, float("-inf"))
        elif use_k:
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
        drop = x < kth
        if triton:  # exactly k: of the logits tied at the k-th value, the lowest ids fill the quota
            above, tied = x > kth, x == kth
            drop = drop | (tied & (tied.cumsum(-1) > top_k - above.sum(-1, keepdim=True)))
        x = x.masked_fill(drop, float("-inf"))
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


def _float32_temperature(temperature: float, device: torch.device) -> torch.Tensor:
    return torch.full((1,), float(temperature), dtype=torch.float32, device=device)


def _check_kept_sets(kept_sets: Optional[KeptSets], token_ids: torch.Tensor, temperature: float) -> None:
    if kept_sets is None:
        return
    if tuple(kept_sets.shape) != tuple(token_ids.shape):
        raise ValueError(f"kept_sets has shape {tuple(kept_sets.shape)} but token_ids has shape "
                         f"{tuple(token_ids.shape)}: one kept set per sampled token")
    if temperature < _SAMPLING_EPS and bool(kept_sets.recorded.any()):
        raise ValueError("kept_sets with greedy sampling (temperature < 1e-5): vLLM replays only temperature > 0")


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
    keep_sampled: bool = True,
    kept_sets: Optional[KeptSets] = None,
    engine_topk_topp: str = "auto",
) -> torch.Tensor | SamplerLogprobs:
    """Token logprobs under vLLM's processed sampling distribution (see the module docstring).

    Args:
        logits: (B, T, V) or (N, V) logits that produced each position's token (any float dtype).
        token_ids: (B, T) or (N,) the sampled tokens; ``logits.shape[:-1]`` must equal its shape.
        temperature, top_k, top_p, min_p: the rollout's ``SamplingParams``.  ``top_k`` None,
            -1 or 0 disables top-k (as in vLLM); temperature < 1e-5 means greedy.
        response_mask: optional (B, T) mask; only positions inside it count as outside.
        return_outside: return a :class:`SamplerLogprobs` (logprobs, outside_mask, num_outside)
            instead of the bare tensor.
        chunk_size: rows processed at once (each row is independent, so results do not depend
            on it; it bounds the (rows, V) temporaries of the sort).
        keep_sampled: the boundary rule: the recomputed kept set always contains the sampled
            token (False: such a token gets -inf and a :class:`SamplerSupportWarning` when
            ``return_outside`` is off).
        kept_sets: the engine's exact kept sets (:class:`~rollout_parity.core.replay.KeptSets`,
            shaped like ``token_ids``): positions with a recorded set renormalise over it.
        engine_topk_topp: the engine's top-k/top-p implementation, whose tie rule the recomputed
            kept set follows: ``"pytorch"`` (vLLM on CPU), ``"triton"`` (vLLM on a GPU) or
            ``"auto"`` (by the device of ``logits``); module docstring, step 5.

    Returns:
        (B, T) float32 logprobs (differentiable w.r.t. ``logits``); or a :class:`SamplerLogprobs`
        when ``return_outside=True``.
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
    _check_kept_sets(kept_sets, token_ids, temperature)
    topk_topp_rule(engine_topk_topp, logits.device)
    vocab = logits.shape[-1]
    ids = _token_indices(token_ids, response_mask, chunk_size, vocab, logits.device,
                         f"vocab of logits {tuple(logits.shape)}")

    flat = logits.reshape(-1, vocab)
    recorded = None if kept_sets is None else kept_sets.recorded.reshape(-1).to(logits.device)
    pieces, outside_pieces = [], []
    for start in range(0, flat.shape[0], chunk_size):
        stop = min(start + chunk_size, flat.shape[0])
        x = processed_logits(flat[start:stop], temperature, top_k, top_p, min_p, engine_topk_topp=engine_topk_topp)
        y = ids[start:stop].unsqueeze(-1)
        missed = torch.isneginf(x.detach().gather(-1, y)).squeeze(-1)
        if recorded is not None and bool(recorded[start:stop].any()):
            rows, kept = kept_sets.flat_rows(start, stop)
            allowed = torch.zeros_like(x, dtype=torch.bool)
            allowed[rows.to(x.device), kept.to(x.device)] = True
            scaled = flat[start:stop].to(torch.float32).div(_float32_temperature(temperature, x.device))
            rec = recorded[start:stop]
            x = torch.where(rec.unsqueeze(-1), scaled.masked_fill(~allowed, float("-inf")), x)
            missed = missed & ~rec  # a replayed position uses the engine's set, not the recomputed one
        if keep_sampled and bool(missed.any()):
            # the boundary rule: the sampled token joins the recomputed kept set
            scaled_y = flat[start:stop].gather(-1, y).to(torch.float32).div(
                _float32_temperature(temperature, x.device)).squeeze(-1)
            r = missed.nonzero().squeeze(-1)
            x = x.index_put((r, y.squeeze(-1)[r]), scaled_y[r])
        lp = x.log_softmax(dim=-1, dtype=torch.float32)
        pieces.append(lp.gather(-1, y).squeeze(-1))
        outside_pieces.append(missed)
    empty = flat.new_zeros(0, dtype=torch.float32)
    out = (torch.cat(pieces) if pieces else empty).reshape(token_ids.shape)
    outside = (torch.cat(outside_pieces) if outside_pieces else empty.bool()).reshape(token_ids.shape)
    if response_mask is not None:
        outside = outside & response_mask.to(device=outside.device).bool()
    num_outside = int(outside.sum())
    if return_outside:
        return SamplerLogprobs(logprobs=out, outside_mask=outside, num_outside=num_outside)
    if num_outside and not keep_sampled:
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

    full:          (...) float32 ``log softmax(z / T)`` over the whole vocabulary (what the
                   trainer's PPO ratio uses).
    processed:     (...) float32 vLLM's processed logprobs (renormalised over the kept set: the
                   engine's where ``kept_sets`` recorded one, else the recomputed one with the
                   boundary rule): what ``r_corr`` must compare with the sampler's logprobs.
    outside_mask:  (...) bool, True where the trainer's recomputed kept set missed the sampled
                   token (inside ``response_mask`` when one was given).
    num_outside:   number of True entries in ``outside_mask``.
    replayed_mask: (...) bool, True where the engine's kept set was used.
    """

    full: torch.Tensor
    processed: torch.Tensor
    outside_mask: torch.Tensor
    num_outside: int
    replayed_mask: Optional[torch.Tensor] = None

    @property
    def num_replayed(self) -> int:
        return 0 if self.replayed_mask is None else int(self.replayed_mask.sum())


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
    chunk_size: int | None = None,
    keep_sampled: bool = True,
    kept_sets: Optional[KeptSets] = None,
    memory_budget: int | None = None,
    engine_topk_topp: str = "auto",
) -> HeadLogprobs:
    """Full-vocabulary and sampler-aware logprobs from the final hidden states, chunk by chunk.

    For recomputing pi_old without ever holding (N, V) logits: each chunk of ``chunk_size``
    rows is projected through the head in float32 into one reused ``(chunk_size, V)`` buffer
    (``(h W^T + b) / T``, the fp32 lm_head of the parity recipe, exact whatever the caller's TF32
    settings, the head never copied whole to fp32: :mod:`rollout_parity.core.head_matmul`) and
    log-softmaxed in place; the sampled token's full logprob is gathered,
    and its processed logprob is ``log p_T(y) - log S`` with ``S`` the kept set's mass: the
    engine's set where ``kept_sets`` records one, else the recomputed set from the row's largest
    probabilities (:mod:`rollout_parity.core.kept_set`; rows it cannot settle take vLLM's sorting
    path, :func:`processed_logits`), with the boundary rule unless ``keep_sampled=False``. On CUDA
    (where Triton imports) Triton kernels read the raw logits instead of the in-place log-softmax and
    ``topk``: the row kernel's log-sum-exp, then each open row's candidates
    (:mod:`rollout_parity.kernels.kept_candidates`), filtered by the same float64 rule. No
    gradient: pi_old is a constant of the loss. ``benchmarks/sampler_pass.py`` times it against
    the plain chunked fp32 pass.

    Args:
        hidden: (..., H) final hidden states at the positions that predict ``token_ids``.
        weight: (V, H) the lm_head weight (any float dtype; projected in float32: a bf16 x bf16
            GEMM with fp32 output on a GPU when hidden and weight are bf16, else upcast per tile).
        token_ids: (...) the sampled tokens, ``hidden.shape[:-1]``.
        temperature, top_k, top_p, min_p: the rollout's ``SamplingParams`` (as in
            :func:`sampler_logprobs`).
        bias: optional (V,) head bias.
        response_mask: optional (...) mask; only positions inside it count as outside.
        chunk_size: rows projected at once; None (default): the most rows whose working set fits
            ``memory_budget`` (:func:`~rollout_parity.core.head_matmul.chunk_rows`).
        keep_sampled, kept_sets, engine_topk_topp: as in :func:`sampler_logprobs` (``"auto"``:
            by the device of ``hidden``).
        memory_budget: bytes for the working set when ``chunk_size`` is None (default:
            :func:`~rollout_parity.core.head_matmul.default_memory_budget` of the device).
    """
    _check_params(temperature, top_k, top_p, min_p)
    if hidden.dim() < 1 or tuple(hidden.shape[:-1]) != tuple(token_ids.shape):
        raise ValueError(
            "hidden must be token_ids.shape + (hidden_size,): got hidden "
            f"{tuple(hidden.shape)} and token_ids {tuple(token_ids.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, {hidden.shape[-1]}), got {tuple(weight.shape)}")
    _check_kept_sets(kept_sets, token_ids, temperature)
    if chunk_size is not None and memory_budget is not None:
        raise ValueError("pass chunk_size or memory_budget, not both: memory_budget chooses the chunk size")
    rule = topk_topp_rule(engine_topk_topp, hidden.device)
    ids = _token_indices(token_ids, response_mask, 1 if chunk_size is None else chunk_size, weight.shape[0],
                         hidden.device, f"rows of weight {tuple(weight.shape)}")

    flat = hidden.reshape(-1, hidden.shape[-1])
    n, vocab = flat.shape[0], weight.shape[0]
    top_k = _top_k_on(top_k, vocab)  # -1, 0 and k >= V mean off (vLLM), on every path alike
    rows = min(chunk_rows(n, vocab, hidden.device, memory_budget) if chunk_size is None else chunk_size, max(n, 1))
    greedy = temperature < _SAMPLING_EPS
    truncates = not greedy and (top_k is not None or top_p < 1.0 or min_p > 0.0)
    full = torch.empty(n, dtype=torch.float32, device=hidden.device)
    processed = torch.empty_like(full)
    outside = torch.zeros(n, dtype=torch.bool, device=hidden.device)
    recorded = None if kept_sets is None else kept_sets.recorded.reshape(-1).to(hidden.device)
    # exact fp32 whatever the caller's TF32 settings; under a trainer's bf16 autocast it would silently run in bf16
    with exact_fp32_matmul(), torch.autocast(device_type=hidden.device.type, enabled=False):
        t_eff = 1.0 if greedy else float(temperature)
        head = HeadProjector(weight, bias, t_eff, flat.dtype, torch.float32, rows)
        buf = torch.empty(rows, vocab, dtype=torch.float32, device=hidden.device)
        kernels = _row_kernels(hidden.device, top_k if truncates else None)
        replay = None if kernels is None or kept_sets is None else _ChunkedKeptSets(kept_sets, rows, n, hidden.device)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            if kernels is not None:  # CUDA: the chunk's logits read by Triton kernels, no (rows, V) pass of torch's
                z = head.logits_into(buf[: stop - start], flat[start:stop], divide=False)
                got = _kernel_chunk(kernels, z, t_eff, ids[start:stop], top_k if truncates else None,
                                    top_p if truncates else 1.0, min_p if truncates else 0.0, keep_sampled, replay,
                                    recorded, start, stop, rule)
                if got is not None:
                    full[start:stop], processed[start:stop], outside[start:stop] = got
                    continue
                kernels = None  # the row kernel failed to launch (warned once): torch's passes from this chunk on
            lp = _softmax_rows_(head.logits_into(buf[: stop - start], flat[start:stop]), log=True)  # log p_T
            y = ids[start:stop]
            lp_y = lp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
            full[start:stop] = lp_y
            if not truncates and (recorded is None or not bool(recorded[start:stop].any())):
                processed[start:stop] = lp_y
                continue
            proc, miss = _processed_chunk(lp, y, lp_y, top_k if truncates else None,
                                          top_p if truncates else 1.0, min_p if truncates else 0.0, keep_sampled,
                                          kept_sets, recorded, start, stop, rule)
            processed[start:stop] = proc
            outside[start:stop] = miss
        head.release()
    shape = token_ids.shape
    full, processed, outside = full.reshape(shape), processed.reshape(shape), outside.reshape(shape)
    if response_mask is not None:
        outside = outside & response_mask.to(device=outside.device).bool()
    replayed = None if recorded is None else recorded.reshape(shape).clone()
    if replayed is not None and response_mask is not None:
        replayed &= response_mask.to(device=replayed.device).bool()
    return HeadLogprobs(full=full, processed=processed, outside_mask=outside, num_outside=int(outside.sum()),
                        replayed_mask=replayed)


def _processed_chunk(lp: torch.Tensor, y: torch.Tensor, lp_y: torch.Tensor, top_k: Optional[int], top_p: float,
                     min_p: float, keep_sampled: bool, kept_sets: Optional[KeptSets], recorded: Optional[torch.Tensor],
                     start: int, stop: int, rule: str,
                     sort_rows: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed logprobs of one chunk of full log-probabilities ``lp``; and where the recomputed set missed y.
    ``rule``: the engine's top-k/top-p tie rule (``"pytorch"`` or ``"triton"``). ``sort_rows``: rows the sorting
    path takes at once (default an eighth of ``lp``'s)."""
    rows = lp.shape[0]
    proc = torch.empty(rows, dtype=torch.float64, device=lp.device)
    miss = torch.zeros(rows, dtype=torch.bool, device=lp.device)
    lp_y64 = lp_y.double()
    rec = recorded[start:stop] if recorded is not None else torch.zeros(rows, dtype=torch.bool, device=lp.device)
    if bool(rec.any()):
        r, kept = kept_sets.flat_rows(start, stop)
        log_s, member = replayed_log_mass(lp, y, r.to(lp.device), kept.to(lp.device), rec)
        # a sampled token missing from the engine's own set is an engine failure: -inf (counted by the core)
        proc = torch.where(rec, torch.where(member, lp_y64 - log_s, float("-inf")), proc)
    rest = (~rec).nonzero().squeeze(-1)
    if rest.numel() == 0:
        return proc.float(), miss
    if top_k is None and top_p >= 1.0 and min_p <= 0.0:
        proc[rest] = lp_y64[rest]  # greedy, or no filter: nothing to renormalise
        return proc.float(), miss
    sub = lp if rest.numel() == rows else lp[rest]
    log_s, smallest, settled = settle_kept_sets(sub, top_k, top_p, min_p, rule=rule)
    done = rest[settled]
    y_sub = lp_y64[done]
    inside = y_sub >= smallest[settled].double()
    proc[done] = _with_rule(y_sub, log_s[settled], inside, keep_sampled)
    miss[done] = ~inside
    # the candidates did not settle these rows: vLLM's sorting path, an eighth of the chunk's rows at a time (its
    # values, ids and sums of a block of rows take about six times the block)
    for hard in rest[~settled].split(sort_rows or max(1, rows // 8)):
        x = processed_logits(lp[hard], 1.0, top_k, top_p, min_p, engine_topk_topp=rule)
        x_y = x.gather(-1, y[hard].unsqueeze(-1)).squeeze(-1)
        inside = ~torch.isneginf(x_y)
        log_s = torch.logsumexp(x, dim=-1).double()  # lp is normalised: log S of the kept set
        proc[hard] = _with_rule(lp_y64[hard], log_s, inside, keep_sampled)
        miss[hard] = ~inside
    return proc.float(), miss


def _row_kernels(device: torch.device, top_k: Optional[int]):
    """The CUDA pass's two Triton kernels, ``(row_logprob_entropy, kept_candidates)``, or None: off an NVIDIA CUDA
    device (CPU, ROCm) or without Triton (the torch passes then). A top-k the candidates' columns cannot hold keeps
    the kernels: its rows go to the torch path one by one (:func:`_kernel_chunk`)."""
    if not kernels_allowed(device):
        return None
    try:
        from ..kernels.kept_candidates import kept_candidates
        from ..kernels.row_logsumexp import row_logprob_entropy
    except ImportError:
        return None
    return row_logprob_entropy, kept_candidates


def _candidate_cover(top_k: Optional[int], top_p: float, min_p: float, cap: int) -> Optional[dict]:
    """The candidates kernel's cover for these filters (:mod:`rollout_parity.kernels.kept_candidates`): the entries
    vLLM's filters renormalise over all lie above its threshold. None where no cover can close: a top-k of ``cap - 1``
    or more (its k entries do not fit the columns), or top-p alone so close to 1 (0.9999 and above) that the mass it
    needs, with the float32 margin, is all the mass a float32 sum tells from 1. Those rows take the torch path."""
    if top_k is not None and top_k >= cap - 1:
        return None
    bound = dict(bound=math.log(min_p) - 1e-3) if min_p > 0.0 else {}  # less a margin for float rounding
    if top_k is not None:
        return dict(count=top_k, **bound)  # with min-p too: the higher of the two thresholds
    if bound:
        return bound
    need = _limit(top_p) + 1e-4  # a float32 sum of the masses may fall short of the float64 one by this much
    return dict(mass=need) if need < 1.0 - 2.0 ** -24 else None


class _ChunkedKeptSets:
    """A call's kept sets for the CUDA pass: their entries moved to the device once, and each chunk's slice found
    from offsets read on the host once (``KeptSets`` lives on the host: per chunk, a read and a copy would each
    wait for the device)."""

    def __init__(self, kept_sets: KeptSets, chunk: int, n: int, device: torch.device) -> None:
        starts = [*range(0, n, chunk), n]
        offsets = kept_sets.offsets
        self.bounds = dict(zip(starts, offsets[starts].tolist()))  # the one read
        rows = torch.repeat_interleave(torch.arange(n, device=offsets.device), offsets.diff(),
                                       output_size=self.bounds[n])
        self.rows = rows.to(device, non_blocking=True)
        self.ids = kept_sets.ids[: self.bounds[n]].to(device, non_blocking=True)

    def recorded_in(self, start: int, stop: int) -> bool:
        """Whether a position of ``start:stop`` has a set (offsets only grow: its entries are not empty)."""
        return self.bounds[stop] > self.bounds[start]

    def flat_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`KeptSets.flat_rows`, on the device."""
        lo, hi = self.bounds[start], self.bounds[stop]
        return self.rows[lo:hi] - start, self.ids[lo:hi]


def _kernel_chunk(kernels, z: torch.Tensor, temperature: float, y: torch.Tensor, top_k: Optional[int], top_p: float,
                  min_p: float, keep_sampled: bool, replay: Optional[_ChunkedKeptSets],
                  recorded: Optional[torch.Tensor], start: int, stop: int,
                  rule: str) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Full and processed logprobs of one chunk from its raw fp32 logits ``z`` (``h W^T + b``, not yet divided by
    T), and where the recomputed set missed y: ``_processed_chunk``'s values without materialising the chunk's
    log-probabilities and with one host synchronisation (whether a row needs the sorting path). None when the row
    kernel failed to launch (:func:`~rollout_parity.core.kernel_launch.launch`): the caller takes the torch path.

    The row kernel reads the chunk once (the row's maximum ``m``, ``log s`` and the token's log-probability
    ``(x - m) - log s``); the rows that one token does not settle go to ``kept_candidates``, which writes each row's
    few entries that can be in the kept set (:mod:`rollout_parity.kernels.kept_candidates`); those are sorted and
    filtered in float64 by ``_on_candidates``, the CPU path's own rule. The rows it leaves open (a failed launch of
    the candidates too) take ``_processed_chunk`` on their log-probabilities ``(div(z, T) - m) - log s``, the same
    float operations as the kernels', formed in place in blocks of an eighth of the chunk."""
    from ..kernels.kept_candidates import CAP

    row_pass, candidates = kernels
    rows, dev = z.shape[0], z.device
    lp_y, rowmax, logsum = (torch.empty(rows, dtype=torch.float32, device=dev) for _ in range(3))
    if not launch("row_logprob_entropy+lse", dev, row_pass, z, y, temperature, lp_y, None, rowmax, logsum):
        return None
    miss = torch.zeros(rows, dtype=torch.bool, device=dev)
    truncates = top_k is not None or top_p < 1.0 or min_p > 0.0
    rec = recorded[start:stop] if replay is not None and replay.recorded_in(start, stop) else None
    if not truncates and rec is None:
        return lp_y, lp_y, miss
    temp = _float32_temperature(temperature, dev)
    lp_y64 = lp_y.double()
    proc = lp_y64.clone()
    todo = torch.full((rows,), truncates, dtype=torch.bool, device=dev)
    if rec is not None:
        r, kept = replay.flat_rows(start, stop)
        vals = (z[r, kept].div(temp) - rowmax[r]) - logsum[r]
        log_s, member = replayed_log_mass_of(vals, y, r, kept, rec)
        # a sampled token missing from the engine's own set is an engine failure: -inf (counted by the core)
        proc = torch.where(rec, torch.where(member, lp_y64 - log_s, float("-inf")), proc)
        todo &= ~rec
    if truncates:
        peak = logsum.neg()  # the row's largest log-probability
        stage = alone_holds_top_p(top_p, rule, lambda: peak)  # settle_kept_sets' first stage
        alone = torch.zeros_like(todo) if stage is None else stage[1]
        settled = alone
        cover = _candidate_cover(top_k, top_p, min_p, CAP)
        # the candidates' buffers only where a cover can close (a (rows, CAP) fill is a pass of its own)
        cand = None if cover is None else torch.full((rows, CAP), float("-inf"), dtype=torch.float32, device=dev)
        count = None if cover is None else torch.empty(rows, dtype=torch.int32, device=dev)
        if cover is not None and launch("kept_candidates+" + "+".join(cover), dev, candidates, z, temperature,
                                        rowmax, logsum, todo & ~alone, cand, count, **cover):
            log_s, smallest, on_cand = _on_candidates(cand.sort(dim=-1, descending=True).values, top_k, top_p, min_p,
                                                      whole=False, rule=rule)
            log_s = torch.where(alone, peak.double(), log_s)
            smallest = torch.where(alone, peak, smallest)
            settled = alone | (on_cand & (count >= 0))  # a row over the cap holds only some of its candidates
        else:  # no cover can close these rows (or the kernel failed to launch): only the alone rows are settled
            log_s, smallest = peak.double(), peak
        inside = lp_y64 >= smallest.double()
        done = todo & settled
        proc = torch.where(done, _with_rule(lp_y64, log_s, inside, keep_sampled), proc)
        miss = done & ~inside
        hard = todo & ~settled
        if bool(hard.any()):
            block = max(1, rows // 8)
            for h in hard.nonzero().squeeze(-1).split(block):
                # one block of log-probabilities at a time, formed in its own copy: no (rows, V) temporaries
                lp = z.index_select(0, h).div_(temp).sub_(rowmax[h, None]).sub_(logsum[h, None])
                p_h, m_h = _processed_chunk(lp, y[h], lp_y[h], top_k, top_p, min_p, keep_sampled, None, None, 0,
                                            h.numel(), rule, sort_rows=block)
                proc[h], miss[h] = p_h.double(), m_h
    return lp_y, proc.float(), miss


def _with_rule(lp_y: torch.Tensor, log_s: torch.Tensor, inside: torch.Tensor, keep_sampled: bool) -> torch.Tensor:
    """``log p(y) - log S`` for a kept token; the boundary rule ``- log(S + p(y))`` (or -inf) for a missed one."""
    added = torch.logaddexp(log_s, lp_y) if keep_sampled else torch.full_like(lp_y, float("inf"))
    return lp_y - torch.where(inside, log_s, added)


def kept_mass_metrics(log_kept_mass: torch.Tensor, response_mask: torch.Tensor, process_group=None, *,
                      outside_mask: Optional[torch.Tensor] = None,
                      replayed_mask: Optional[torch.Tensor] = None) -> dict[str, float]:
    """What sampler-aware pi_old removed from r_corr, and where the recomputed kept set missed.

    ``log_kept_mass`` is ``log p_T(y) - log q(y)`` per token (full minus processed logprobs): the
    log S each token's processed logprob was renormalised by. Returns, over the valid tokens of
    ``response_mask`` (all-reduced over ``process_group`` when given):

    * ``rollout_correction/sampler_log_kept_mass``: mean log S over the valid tokens where it is
      finite, the bias a full-vocabulary pi_old would have put into every log r_corr;
    * ``rollout_correction/sampler_outside_kept_frac``: the share of valid tokens the trainer's
      recomputed kept set missed (trainer and engine logits on different sides of the nucleus
      edge), from ``outside_mask``: they got the boundary rule (``core/sampler.py``). Without
      ``outside_mask``, a token is counted where ``log_kept_mass`` is +inf (the strict reading);
    * with ``replayed_mask``, ``rollout_correction/sampler_replayed_frac``: the share of valid
      tokens renormalised over the engine's own kept set (sampling replay).

    A NaN (non-finite inputs, counted by the core) is in none of them.
    """
    check_shapes("response_mask", response_mask, log_kept_mass=log_kept_mass, outside_mask=outside_mask,
                 replayed_mask=replayed_mask)
    valid = response_mask.detach() != 0
    log_s = log_kept_mass.detach().to(torch.float64)
    inside = valid & torch.isfinite(log_s)
    outside = valid & (torch.isposinf(log_s) if outside_mask is None else outside_mask.detach().bool())
    replayed = valid & (torch.zeros_like(valid) if replayed_mask is None else replayed_mask.detach().bool())
    sums = torch.stack([torch.where(inside, log_s, 0.0).sum(), inside.sum().to(torch.float64),
                        outside.sum().to(torch.float64), valid.sum().to(torch.float64),
                        replayed.sum().to(torch.float64)])
    total, n_inside, n_outside, n_valid, n_replayed = all_reduce(sums, process_group).tolist()
    out = {"rollout_correction/sampler_log_kept_mass": total / n_inside if n_inside else 0.0,
           "rollout_correction/sampler_outside_kept_frac": n_outside / n_valid if n_valid else 0.0}
    if replayed_mask is not None:
        out["rollout_correction/sampler_replayed_frac"] = n_replayed / n_valid if n_valid else 0.0
    return out


def rollout_on_full_vocabulary(rollout_logprobs: torch.Tensor, full_old: torch.Tensor,
                               processed_old: torch.Tensor) -> torch.Tensor:
    """pi_rollout on the trainer's full-vocabulary support: ``log q + log S``, for bypass.

    Under ``old_logprob_source=bypass`` the PPO ratio is pi_theta / pi_rollout. With a truncating
    sampler the engine's processed log q = log p_T - log S is renormalised over the kept set while
    the trainer's pi_theta is a full-vocabulary log-softmax, so the ratio would carry log S, a bias
    of one sign (verl#6240). Adding the trainer's log S (``full_old - processed_old``, measured at
    the same weights) puts pi_rollout back on the trainer's support; at parity the ratio is then 1.
    A token the recomputed kept set missed has a finite log S under the boundary rule (the set
    with the token added), so it moves like any other. Where the result is still not finite (an
    engine NaN / inf, a token missing from the engine's own replayed set, or a strict -inf
    ``processed_old``), the trainer's own ``full_old`` stands in (a neutral ratio), as the
    bad-input rules ask (docs/flags.md); those tokens are counted in ``nonfinite_frac``.
    """
    check_shapes("rollout_logprobs", rollout_logprobs, full_old=full_old, processed_old=processed_old)
    log_s = full_old - processed_old
    moved = rollout_logprobs + log_s.to(rollout_logprobs.dtype)
    return torch.where(torch.isfinite(moved), moved, full_old.to(rollout_logprobs.dtype))
