"""Shared pieces of the real TRL GRPO runs in the tests: config, data, a deliberate mismatch, a recorder.

``Recorder`` watches a live ``GRPOTrainer`` from the outside, without touching the names the
adapter patches: it wraps ``compute_loss`` (TRL's public entry) to keep each micro-batch's inputs
and a forward hook on the model keeps the per-token log-probs of the loss with their gradient.
``shifted_sampler`` moves vLLM's per-token logprobs by a known amount before TRL sees them, so a
correction has something to do and every number has a closed form.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["grpo_args", "reward_distinct_chars", "prompts_dataset", "shifted_sampler", "Recorder", "naive_channels",
           "captured_engine_kwargs",
           "finite", "DISTRIBUTED_ENV", "restored_distributed_env", "subprocess_env"]

#: What TRL's colocated engine sets in ``os.environ`` (``_init_vllm``: RANK, LOCAL_RANK, WORLD_SIZE and
#: ``ensure_master_addr_port``) and a child process must not inherit from a test process.
DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def restored_distributed_env() -> Iterator[None]:
    """Give ``os.environ``'s distributed variables back as they were (TRL's engine setup changes them).

    Inside, ``MASTER_PORT`` is a free port unless already set: accelerate's CPU state writes 29500 when it
    is unset, and a second TRL process on the machine (another run, a benchmark) may hold that port.
    """
    from integration_tests.support.processes import free_port

    saved = {k: os.environ.get(k) for k in DISTRIBUTED_ENV}
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(free_port())
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def subprocess_env(**extra: str) -> dict:
    """This process's environment without its distributed variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env.update(extra)
    return env


def grpo_args(tmp_dir: str, config_class: Any = None, **overrides: Any) -> Any:
    """A CPU GRPO config: tiny batches, two completions of at most 12 tokens per prompt.

    Its ``seed`` (TRL's prompt order, hence the completions vLLM samples) is :func:`spread.seed`: the suite's 0, or
    the seed ``scripts/measure_spread.py`` varies.
    """
    from integration_tests.support.spread import seed

    if config_class is None:
        from rollout_parity.adapters.trl import ParityGRPOConfig as config_class
    base = dict(output_dir=str(tmp_dir), use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=seed(),
                per_device_train_batch_size=4, num_generations=4, max_completion_length=12, max_steps=2,
                logging_steps=1, learning_rate=1e-2, model_init_kwargs={"dtype": "float32"})
    base.update(overrides)
    return config_class(**base)


def reward_distinct_chars(completions: list, **kwargs: Any) -> list[float]:
    return [float(len(set(c[0]["content"] if isinstance(c, list) else c))) for c in completions]


def prompts_dataset(n: int = 8):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"what is {i} plus {i}?"}] for i in range(n)]})


def shifted_sampler(generate: Callable, shifts: Sequence[float]) -> Callable:
    """TRL's ``VLLMGeneration.generate`` with token j's logprob moved by ``shifts[j % len(shifts)]``."""

    def shifted(*args: Any, **kwargs: Any):
        prompt_ids, completion_ids, logprobs, extra = generate(*args, **kwargs)
        logprobs = [[[lp[0] + shifts[j % len(shifts)]] + lp[1:] for j, lp in enumerate(seq)] for seq in logprobs]
        return prompt_ids, completion_ids, logprobs, extra

    shifted.original = generate
    return shifted


class Recorder:
    """Keeps each loss micro-batch's inputs and the gradient of its per-token log-probs."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.inputs: list[dict] = []
        self.logps: list[torch.Tensor] = []
        self._compute_loss = trainer.compute_loss

        def recording_compute_loss(model, inputs, *args, **kwargs):
            self.inputs.append(dict(inputs))
            return self._compute_loss(model, inputs, *args, **kwargs)

        def keep_logps(module, args, output):
            if torch.is_grad_enabled() and getattr(output, "log_probs", None) is not None \
                    and output.log_probs.requires_grad:
                output.log_probs.retain_grad()
                self.logps.append(output.log_probs)

        trainer.compute_loss = recording_compute_loss
        self._hook = trainer.model.register_forward_hook(keep_logps)

    def clear(self) -> None:
        self.inputs.clear()
        self.logps.clear()

    def token_grads(self, i: int) -> torch.Tensor:
        """(B, T) gradient of micro-batch ``i``'s loss w.r.t. its completion tokens' log-probs."""
        T = self.inputs[i]["completion_ids"].shape[1]
        return self.logps[i].grad[:, -T:]

    def close(self) -> None:
        self._hook.remove()
        self.trainer.__dict__.pop("compute_loss", None)


def naive_channels(inputs: dict, upper: float, k3_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-truncated IS weights and token-K3 keep mask, written out (paper eq. 6 and eq. 8-11).

    ``r = exp(pi_old - pi_rollout)`` on TRL's loss tokens; ``w = min(r, upper)``; a token stays in the
    loss when ``r - 1 - log r <= k3_max``. Returns (w, keep) as TRL's channels carry them: w is 1
    where the token is out of the loss.
    """
    loss = inputs["completion_mask"].bool()
    if inputs.get("rollout_parity/trl/tool_mask") is not None:
        loss &= inputs["rollout_parity/trl/tool_mask"].bool()
    log_r = (inputs["old_per_token_logps"] - inputs.get("rollout_parity/trl/sampling_per_token_logps",
                                                        inputs["sampling_per_token_logps"])).double()
    r = log_r.exp()
    keep = loss & (r - 1 - log_r <= k3_max)
    w = torch.where(keep, r.clamp(max=upper), torch.ones_like(r)).float()
    return w, keep


def finite(values: Any) -> bool:
    return all(v is None or math.isfinite(v) for v in values)


class _EngineKwargs(Exception):
    def __init__(self, kwargs: dict) -> None:
        super().__init__("engine kwargs recorded")
        self.kwargs = kwargs


def captured_engine_kwargs(tmp_dir: Any, model: str, *, parity: bool = True, **overrides: Any) -> dict:
    """The kwargs TRL's colocated engine gets from a real ``ParityGRPOTrainer`` (``parity=False``: TRL's own
    ``GRPOTrainer``) with ``overrides`` on ``grpo_args``: TRL's ``vllm.LLM`` name records them and stops the
    build, so no engine starts; ``integration_tests/support/vllm_config_check.py`` validates them."""
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation

    from rollout_parity.adapters.trl import ParityGRPOTrainer

    def record(*args: Any, **kwargs: Any) -> Any:
        raise _EngineKwargs(kwargs)

    trainer_class, config_class = (ParityGRPOTrainer, None) if parity else (GRPOTrainer, GRPOConfig)
    args = grpo_args(tmp_dir, config_class, use_vllm=True, vllm_mode="colocate", **overrides)
    real = vllm_generation.LLM
    with restored_distributed_env():
        vllm_generation.LLM = record
        try:
            trainer_class(model=model, reward_funcs=reward_distinct_chars, args=args, train_dataset=prompts_dataset())
        except _EngineKwargs as recorded:
            return recorded.kwargs
        finally:
            vllm_generation.LLM = real
    raise RuntimeError("TRL built its trainer without calling vllm.LLM")
