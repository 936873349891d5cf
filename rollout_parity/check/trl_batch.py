"""Drive a real ``GRPOTrainer`` with a given batch: the shared cross-framework batch through TRL.

Used by ``rollout-parity check`` and by the suite's TRL tests (one copy).

What runs is TRL's own code: ``_generate_and_score_completions`` (padding, masks, its pi_old
forward, rewards, advantages, ``num_items_in_batch``, its importance-sampling code) and
``_compute_loss`` (every loss type and option), with the adapter's patches on top. Two things
stand in for what a test can not have:

* the sampler is TRL's public ``rollout_func`` hook, returning the batch's completions and
  rollout logprobs (and TRL's ``env_mask`` for rows that must be out of the loss);
* the network is replaced at the model's ``forward`` only (:class:`LogprobForward`): TRL calls
  ``model(..., fused_lm_head=True)`` and gets ``log_probs`` whose completion part is the batch's
  pi_old (under ``no_grad``: TRL's pi_old forward) or pi_theta (with grad: the loss's forward).
  Rows are found by the prompt token ``[7, row]``, so TRL's chunking and shuffling are honoured.

TRL keeps sampler logprobs and applies ``importance_sampling_ratio`` only with ``use_vllm=True``; a
trainer built without an engine is told it has one (``use_vllm=True`` after construction, weights
marked as synced), which is what a ``rollout_func`` user with vLLM looks like to ``_generate``.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

__all__ = ["PROMPT_TOKEN", "LogprobForward", "stub_forward", "pretend_vllm_trainer", "rollout_func_for",
           "generation_batch", "through_trl"]

PROMPT_TOKEN = 7
COMPLETION_TOKEN = 9


class LogprobForward:
    """The model forward TRL's fused head would run, returning given per-token logprobs.

    ``old`` (B, T) is returned under ``no_grad`` (TRL's pi_old forward), ``current`` (B, T) with
    grad enabled (the loss's forward; make it a leaf with ``requires_grad`` to read its gradient).
    """

    def __init__(self, old: torch.Tensor, current: torch.Tensor):
        self.old, self.current = old, current
        self.calls = {"old": 0, "current": 0}

    def __call__(self, input_ids: torch.Tensor, attention_mask: Any = None, labels: Any = None, **kwargs: Any):
        rows = input_ids[:, 1].long()
        which = "current" if torch.is_grad_enabled() else "old"
        self.calls[which] += 1
        table = self.current if which == "current" else self.old
        logps = table[rows][:, : input_ids.shape[1] - 2]  # the prompt is [7, row]; TRL pads completions per batch
        pad = logps.new_zeros(input_ids.shape[0], input_ids.shape[1] - 1 - logps.shape[1])
        log_probs = torch.cat([pad, logps], dim=1)
        return SimpleNamespace(log_probs=log_probs, entropy=torch.zeros_like(log_probs.detach()), aux_loss=None)


@contextlib.contextmanager
def stub_forward(trainer: Any, forward: LogprobForward) -> Iterator[LogprobForward]:
    """Replace the trainer's model forward (TRL's fused head) for the block."""
    model = trainer.model
    saved = model.__dict__.get("forward")
    model.forward = forward
    try:
        yield forward
    finally:
        if saved is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = saved


def rollout_func_for(rollout_logprobs: torch.Tensor, lengths: Sequence[int], row_offset: int = 0,
                     loss_rows: Optional[torch.Tensor] = None):
    """TRL's ``rollout_func`` returning rows ``row_offset + i`` of a batch.

    An empty completion can not exist in TRL (it reads ``ids[-1]``): such a row becomes one token
    that TRL's own ``env_mask`` takes out of the loss. ``loss_rows`` (B, T) bool, if given, is the
    ``env_mask`` of every row (False: a token out of TRL's loss, e.g. a tool result).
    """

    def rollout_func(prompts: list, trainer: Any) -> dict:
        rows = [row_offset + i for i in range(len(prompts))]
        out = {"prompt_ids": [[PROMPT_TOKEN, r] for r in rows], "completion_ids": [], "logprobs": [], "env_mask": []}
        for r in rows:
            n = int(lengths[r])
            out["completion_ids"].append([COMPLETION_TOKEN] * max(n, 1))
            out["logprobs"].append(rollout_logprobs[r, :n].tolist() or [0.0])
            env = [1] * n if loss_rows is None else [int(x) for x in loss_rows[r, :n].tolist()]
            out["env_mask"].append(env or [0])
        return out

    return rollout_func


def pretend_vllm_trainer(tmp_dir: str, batch_size: int, max_completion_length: int, model: Optional[str] = None,
                         reward_funcs: Any = None, **overrides: Any):
    """A real ``GRPOTrainer`` (tiny local model by default), told it generates with vLLM (see the module doc)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rollout_parity.testing.tiny_model import build_tiny_model

    config = dict(output_dir=tmp_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
                  per_device_train_batch_size=batch_size, num_generations=2, loss_type="bnpo",
                  max_completion_length=max_completion_length, model_init_kwargs={"dtype": "float32"})
    config.update(overrides)
    args = GRPOConfig(**config)
    dataset = Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(batch_size)]})
    if reward_funcs is None:
        reward_funcs = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731 - advantages are given
    trainer = GRPOTrainer(model=model or build_tiny_model(), reward_funcs=reward_funcs, args=args,
                          train_dataset=dataset)
    trainer.use_vllm = True
    trainer._last_loaded_step = trainer.state.global_step  # "synced": there is no engine to sync into
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop; the tests call the loss directly
    trainer.model.train()
    return trainer


def generation_batch(trainer: Any, n_rows: int) -> list[dict]:
    """The inputs ``_generate_and_score_completions`` takes: one prompt per row."""
    return [{"prompt": f"prompt {i}"} for i in range(n_rows)]


def through_trl(trainer: Any, cfg: Any, loss_type: str, batch: Any, rollout: Optional[torch.Tensor] = None,
                loss_rows: Optional[torch.Tensor] = None, lengths: Optional[Sequence[int]] = None,
                row_offset: int = 0, n_rows: Optional[int] = None,
                tamper: Optional[Callable[[dict], None]] = None):
    """A shared-batch-like ``batch`` through TRL's generation and loss with ``cfg`` applied (None: TRL alone).

    This rank's rows are ``row_offset + i`` for ``i < n_rows``. Returns ``(loss, d loss / d pi_theta
    (B, T), this rank's logged metrics, TRL's batch dict)``; the advantages are the batch's.
    ``tamper(inputs)``, if given, may change TRL's batch dict between generation and the loss
    (``rollout-parity check``'s self-test corrupts a weight there).
    """
    from rollout_parity.adapters import trl as trl_adapter

    n_rows = batch.old_logprobs.shape[0] if n_rows is None else n_rows
    trainer.loss_type = loss_type
    lengths = batch.response_mask.sum(-1).long().tolist() if lengths is None else lengths
    trainer.rollout_func = rollout_func_for(batch.rollout_logprobs if rollout is None else rollout, lengths,
                                            row_offset=row_offset, loss_rows=loss_rows)
    if cfg is not None:
        trl_adapter.apply(trainer, cfg)
    current = batch.fresh_current()
    trainer._metrics["train"].clear()
    with stub_forward(trainer, LogprobForward(batch.old_logprobs.clone(), current)):
        inputs = trainer._generate_and_score_completions(generation_batch(trainer, n_rows))
        inputs["advantages"] = batch.advantages[row_offset:row_offset + n_rows].clone()  # TRL's come from rewards
        if tamper is not None:
            tamper(inputs)
        loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return loss.detach(), current.grad, metrics, inputs
