"""Weight-sync verification: does the engine hold the weights the trainer just stepped?

Parity assumes it; no framework checks it, and sync bugs are silent (fused MoE layouts, LoRA merges,
tied embeddings, a parameter group never sent). After a sync, a small fixed probe is scored on both
sides at the same weights: the engine continues :class:`SyncProbe`'s fixed prompts at the trainer's
temperature (no top-k/top-p, so its processed logprobs are the plain ``log_softmax(logits / T)``; the request's
parameters per engine: ``engines/vllm/probe.py``) and returns its logprobs; the trainer scores the same tokens in one forward
(:func:`trainer_probe_logprobs`, or the framework's own log-prob pass). :func:`judge` compares the
trimmed mean |delta logprob| (the largest 1/16 of the gaps left out) with ``weight_sync_check_threshold``,
set well above the parity level a healthy sync reaches and well below what a stale or corrupted one shows
(docs/moe_sync_check.md, "The sync check": the measured levels). Trimmed, because a healthy MoE sync can move one
token by nats (4.0 nats on one of 32 tokens in a real verl run, 0.136 untrimmed against 0.012 for the
other 31; most likely the bf16 engine and the fp32 trainer routing it to different experts, not traced),
while weights the sync left behind move every token. A failed check is a :class:`WeightSyncError` naming the parameter groups that
can be told apart: those the sync never handed to the engine (:func:`unsent_groups`).

Generated-token logprobs rather than prompt logprobs: every engine channel returns them (TRL's
server protocol and verl's token-in-token-out server return no prompt logprobs).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Optional, Sequence

import torch

__all__ = ["SyncProbe", "make_probe", "trainer_probe_logprobs",
           "SyncCheckResult", "WeightSyncError", "judge",
           "parameter_group", "unsent_groups", "SyncSchedule"]


@dataclasses.dataclass(frozen=True)
class SyncProbe:
    """Fixed prompts (token ids) the engine continues by ``new_tokens`` tokens, sampled with ``seed``."""

    prompts: tuple[tuple[int, ...], ...]
    new_tokens: int = 8
    seed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompts) * self.new_tokens


def make_probe(vocab_size: int, *, num_prompts: int = 4, prompt_len: int = 16, new_tokens: int = 8,
               seed: int = 0) -> SyncProbe:
    """A deterministic probe: ``num_prompts`` prompts of ``prompt_len`` token ids drawn from ``[0, vocab_size)``."""
    if vocab_size < 2 or num_prompts < 1 or prompt_len < 1 or new_tokens < 1:
        raise ValueError(f"make_probe needs vocab_size >= 2 and positive sizes, got vocab_size={vocab_size}, "
                         f"num_prompts={num_prompts}, prompt_len={prompt_len}, new_tokens={new_tokens}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_prompts, prompt_len), generator=gen)
    return SyncProbe(tuple(tuple(int(t) for t in row) for row in ids), new_tokens, seed)


def trainer_probe_logprobs(model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                           temperature: float = 1.0, device: Any = None) -> torch.Tensor:
    """(N, K) logprobs of each completion token under a Hugging Face causal LM, ``log_softmax(logits / T)``
    in fp32; one forward of the right-padded batch (padding sits after every scored token). ``device``: where
    the model computes (default: where its parameters are; a trainer that keeps them offloaded names its own)."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    width, k = max(lengths), max(len(c) for c in completions)
    device = next(model.parameters()).device if device is None else torch.device(device)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, :lengths[i]] = torch.tensor(list(p) + list(c), device=device)
        mask[i, :lengths[i]] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    out = torch.full((len(prompts), k), float("nan"))
    for i, (p, c) in enumerate(zip(prompts, completions)):
        rows = logits[i, len(p) - 1:len(p) - 1 + len(c)].float() / temperature
        out[i, :len(c)] = rows.log_softmax(-1).gather(-1, ids[i, len(p):lengths[i], None])[:, 0].cpu()
    return out


@dataclasses.dataclass(frozen=True)
class SyncCheckResult:
    """One check's verdict: the probe's trimmed mean |delta logprob| against ``threshold``; its plain mean and
    max beside it."""

    sync_index: int
    delta_abs_mean: float
    delta_abs_max: float
    threshold: float
    tokens: int
    unsent: tuple[str, ...] = ()
    sent_known: bool = False  # whether the caller recorded what the sync handed to the engine
    delta_abs_trimmed_mean: Optional[float] = None  # what decides (judge sets it); None: the plain mean
    trimmed: int = 0  # how many of the largest gaps the trimmed mean leaves out

    @property
    def decisive(self) -> float:
        return self.delta_abs_mean if self.delta_abs_trimmed_mean is None else self.delta_abs_trimmed_mean

    @property
    def ok(self) -> bool:
        """The gap decides; ``unsent`` only explains a failure (a group not sent while it still equals the
        engine's copy, e.g. before the first optimizer step, is no error)."""
        return self.decisive <= self.threshold

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        return {f"{prefix}probe_delta_abs_mean": self.delta_abs_mean,
                f"{prefix}probe_delta_abs_trimmed_mean": self.decisive,
                f"{prefix}probe_delta_abs_max": self.delta_abs_max, f"{prefix}check_failed": float(not self.ok)}

    def message(self) -> str:
        trimmed = (f"trimmed mean |delta| {self.decisive:.3g} (the largest {self.trimmed} of {self.tokens} gaps "
                   f"left out; mean {self.delta_abs_mean:.3g}" if self.trimmed else
                   f"mean |delta| {self.decisive:.3g} ({self.tokens} tokens")
        head = (f"weight sync {self.sync_index}: the engine's logprobs on the sync probe differ from the trainer's at "
                f"the same weights by {trimmed}, max {self.delta_abs_max:.3g}); weight_sync_check_threshold is "
                f"{self.threshold:g}")
        if self.ok:
            return head + ": ok" + (f" (not sent in this sync: {', '.join(self.unsent)})" if self.unsent else "")
        if self.unsent:
            return (f"{head}. Never handed to the engine in this sync (left at their old values): "
                    f"{', '.join(self.unsent)}")
        cause = ("the engine's loader or its post-load processing changed them (a layout the loader misreads, a "
                 "kernel layout a raw load bypasses: docs/moe.md), or the sync sent stale values")
        if self.sent_known:
            return f"{head}. Every trainer parameter was sent: {cause}"
        return f"{head}. A parameter group the sync did not send (left at its old values), or {cause}"


class WeightSyncError(RuntimeError):
    """A weight-sync check failed: the engine does not hold the trainer's weights."""

    def __init__(self, result: SyncCheckResult) -> None:
        super().__init__(result.message())
        self.result = result


def judge(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, threshold: float, *,
          sync_index: int = 0, unsent: Optional[Iterable[str]] = None) -> SyncCheckResult:
    """Compare the two sides on the probe's tokens (NaN entries, e.g. a short completion, are skipped);
    a non-finite logprob on one side only counts as a gap of +inf. The verdict reads the mean gap with the
    largest ``n // 16`` of the ``n`` gaps left out (none below 16 tokens; 2 of the default probe's 32): one
    token a MoE routes differently on the two sides is no stale weight. ``unsent``: the groups the sync did
    not hand over (:func:`unsent_groups`), when the caller recorded what it sent; None when it did not."""
    if engine_logprobs.shape != trainer_logprobs.shape:
        raise ValueError(f"engine logprobs {tuple(engine_logprobs.shape)} and trainer logprobs "
                         f"{tuple(trainer_logprobs.shape)} disagree in shape")
    engine, trainer = engine_logprobs.double().flatten(), trainer_logprobs.double().flatten()
    valid = ~(engine.isnan() | trainer.isnan())
    delta = (engine[valid] - trainer[valid]).abs()
    delta = torch.where(delta.isnan(), torch.zeros_like(delta), delta)  # -inf on both sides: no gap
    mean = float(delta.mean()) if delta.numel() else 0.0
    top = float(delta.max()) if delta.numel() else 0.0
    trim = delta.numel() // 16
    kept = delta.sort().values[:delta.numel() - trim]
    trimmed = float(kept.mean()) if kept.numel() else 0.0
    return SyncCheckResult(sync_index, mean, top, float(threshold), int(valid.sum()), tuple(unsent or ()),
                           sent_known=unsent is not None, delta_abs_trimmed_mean=trimmed, trimmed=trim)


_LAYER = re.compile(r"^(.*?\blayers\.\d+\.[A-Za-z_]+)")


def parameter_group(name: str) -> str:
    """The group a parameter name belongs to: ``model.layers.3.mlp`` for ``model.layers.3.mlp.experts.down_proj``,
    the module path otherwise (``model.embed_tokens``, ``lm_head``)."""
    match = _LAYER.match(name)
    if match:
        return match.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def unsent_groups(expected: Iterable[str], sent: Iterable[str]) -> tuple[str, ...]:
    """Groups (:func:`parameter_group`) with a parameter in ``expected`` that is not in ``sent``, each named once
    with the count it is missing, e.g. ``model.layers.1.mlp (2 of 3 tensors)``."""
    sent = set(sent)
    missing: dict[str, list[int]] = {}
    for name in expected:
        counts = missing.setdefault(parameter_group(name), [0, 0])
        counts[1] += 1
        counts[0] += name not in sent
    return tuple(f"{g} ({m} of {n} tensors)" for g, (m, n) in missing.items() if m)


class SyncSchedule:
    """Which syncs get checked: the first, then every ``interval``-th (``interval`` 0 or None: none)."""

    def __init__(self, interval: Optional[int]) -> None:
        self.interval, self.count = int(interval or 0), 0

    def next_is_checked(self) -> bool:
        """Count one sync; True if it is checked."""
        self.count += 1
        return bool(self.interval) and (self.count - 1) % self.interval == 0
