"""The ``precision`` flag in TRL: one compute dtype for TRL's trainer and its vLLM engine (``core/precision.py``).

What sets each side's dtype in TRL 1.16 (with transformers 5 and accelerate 1.15):

* the trainer's forward: TRL runs every log-prob pass under ``accelerator.autocast()``
  (``GRPOTrainer._get_per_token_logps_and_entropies``), which autocasts the matmuls to the mixed precision of
  ``fp16`` / ``bf16`` (``TrainingArguments``; TRL's ``bf16`` defaults to ``not fp16``) over weights kept in their
  load dtype: ``model_init_kwargs["dtype"]`` for a model given by name (TRL's default ``float32``,
  ``create_model_from_path``), a model instance's own otherwise. Without autocast the forward computes in the
  weights' dtype.
* fp16 training is fp32 weights under fp16 autocast with accelerate's ``GradScaler`` (``Accelerator.__init__``),
  and torch's GradScaler refuses float16 gradients ("Attempting to unscale FP16 gradients", at the first
  optimizer step): the weights stay float32. On a cpu device accelerate turns neither fp16 autocast nor the
  scaler on (``native_amp`` stays False, without a word), so there the forward would compute in float32: on cpu
  the flag loads float16 weights instead (no loss scaling, which accelerate gives no cpu run).
* TRL's colocated ``vllm.LLM`` gets no ``dtype`` (vLLM's ``auto``: the checkpoint's); ``trl vllm-serve`` takes
  ``--dtype``.

The flag sets ``fp16`` / ``bf16`` (a contradicting value given explicitly is refused), the load dtype where the
user left it unset, and the engine's ``dtype`` (``engine.py``); :func:`refuse_trainer_precision` and
:func:`check_engine_precision` read both sides back from the built trainer and engine. Without the flag, a
trainer and engine computing in different dtypes get one warning. docs/trl.md.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from rollout_parity.engines.vllm.fp16_models import refuse_fp16_model
from rollout_parity.core.config import FlagError
from rollout_parity.core.precision import engine_dtype, precision_of_dtype

__all__ = ["MIXED_PRECISION", "load_dtypes", "mixed_precision_onto_config", "precision_onto_args",
           "trainer_precision", "refuse_trainer_precision", "check_engine_precision"]

logger = logging.getLogger("rollout_parity.adapters.trl")

#: precision -> TRL's own ``(fp16, bf16)``.
MIXED_PRECISION = {"bf16": (False, True), "fp16": (True, False), "fp32": (False, False)}
_MIXED_NAME = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}  # TrainingArguments.mixed_precision
_GRAD_SCALER = ("HF's fp16 training keeps float32 weights under fp16 autocast with a GradScaler, which refuses "
                "float16 gradients ('Attempting to unscale FP16 gradients') at the first optimizer step")


def _fp16_autocasts(device_type: str) -> bool:
    """Whether accelerate runs fp16 autocast on this device (``Accelerator.__init__``: not on cpu)."""
    return device_type != "cpu"


def load_dtypes(precision: str, device_type: str) -> tuple[str, ...]:
    """The weights' dtypes under which the trainer computes in ``precision`` on ``device_type``; the first is
    the one the flag loads where the user set none."""
    if precision == "fp16":
        return ("float32",) if _fp16_autocasts(device_type) else ("float16",)
    return ("float32", "bfloat16") if precision == "bf16" else ("float32",)


def mixed_precision_onto_config(config: Any, precision: str) -> None:
    """TRL's ``fp16`` / ``bf16`` for ``precision``, on a ``ParityGRPOConfig`` before TRL's ``__post_init__``
    (``bf16`` is still None there unless given): an explicit contradicting value is refused."""
    fp16, bf16 = MIXED_PRECISION[precision]
    given = {"fp16": config.fp16} if config.fp16 else {}
    if config.bf16 is not None:
        given["bf16"] = config.bf16
    wrong = {k: v for k, v in given.items() if v != {"fp16": fp16, "bf16": bf16}[k]}
    if wrong:
        setting = ", ".join(f"{k}={v}" for k, v in wrong.items())
        raise FlagError(f"precision={precision!r} with {setting}: TRL's trainer would compute in another dtype than "
                         f"the engine's {engine_dtype(precision)}; drop {' and '.join(wrong)} (precision sets "
                         f"fp16={fp16}, bf16={bf16}) or drop precision")
    config.fp16, config.bf16 = fp16, bf16


def _configured_dtype(args: Any, model: Any, model_config: Any) -> tuple[Optional[str], str]:
    """The weights' dtype as configured (None: unset) and where it is set, before TRL loads the model."""
    if not isinstance(model, str):
        return str(getattr(model, "dtype", None)).replace("torch.", ""), "the model passed in"
    kwargs = args.model_init_kwargs or {}
    key = "dtype" if "dtype" in kwargs else "torch_dtype" if "torch_dtype" in kwargs else None
    if key is None:
        return None, "model_init_kwargs"
    value = kwargs[key]
    if value is None or value == "auto":  # the checkpoint's dtype (transformers 5)
        saved = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
        return (None if saved is None else str(saved).replace("torch.", "")), f"model_init_kwargs {key}={value!r}"
    return str(value).replace("torch.", ""), f"model_init_kwargs {key}"


def precision_onto_args(precision: str, args: Any, model: Any, model_config: Any) -> None:
    """Before ``GRPOTrainer.__init__`` loads anything: TRL's ``fp16`` / ``bf16`` (a plain ``GRPOConfig``, whose
    ``__post_init__`` has run: set, each change logged) and the weights' load dtype (set where unset, refused
    where it contradicts ``precision``)."""
    if precision == "fp16":  # vLLM's own refusal, named at start instead of when the engine builds
        refuse_fp16_model(model_config if model_config is not None else model, "the model")
    fp16, bf16 = MIXED_PRECISION[precision]
    for name, value in (("fp16", fp16), ("bf16", bf16)):
        if getattr(args, name) != value:
            logger.info("rollout-parity: %s: %r -> %r (precision=%s)", name, getattr(args, name), value, precision)
            setattr(args, name, value)
    if getattr(args, "mixed_precision", None) not in (None, _MIXED_NAME[precision]):  # read by Trainer's Accelerator
        args.mixed_precision = _MIXED_NAME[precision]
    device = args.device.type
    allowed = load_dtypes(precision, device)
    if precision == "fp16" and getattr(args, "deepspeed", None):  # DeepSpeed's fp16: fp16 module, fp32 master copy
        allowed = tuple(dict.fromkeys((*allowed, "float16")))
    dtype, where = _configured_dtype(args, model, model_config)
    if dtype is None and where == "model_init_kwargs":  # unset: TRL would load float32
        if allowed[0] != "float32":
            logger.warning("rollout-parity: model_init_kwargs dtype: float32 (TRL's default) -> %s (precision=%s on %s: "
                           "accelerate runs no fp16 autocast there, so the weights carry the dtype). Training float16 "
                           "weights without loss scaling can collapse: the truncated-sampling GRPO experiment did on "
                           "a CPU (docs/evidence.md); on a GPU the flag keeps float32 weights with a GradScaler",
                           allowed[0], precision, device)
            args.model_init_kwargs = {**(args.model_init_kwargs or {}), "dtype": allowed[0]}
        return
    if dtype in allowed:
        return
    if dtype is None:
        reason = "the checkpoint's dtype could not be read"
    elif precision == "fp16" and dtype == "float16":
        reason = _GRAD_SCALER
    elif precision == "fp16" and not _fp16_autocasts(device):
        reason = (f"accelerate runs no fp16 autocast on a {device} device, so the trainer would compute in {dtype} "
                  "against a float16 engine")
    else:
        reason = f"the trainer would compute in {dtype}, not {engine_dtype(precision)}"
    fix = "load it in" if not isinstance(model, str) else "leave dtype unset or set"
    raise FlagError(f"precision={precision!r} with {where} {dtype} on {device}: {reason}; {fix} "
                     f"{' or '.join(allowed)}")


def trainer_precision(trainer: Any) -> tuple[Optional[str], str]:
    """The built trainer's compute precision and how it arises: the autocast of accelerate's mixed precision
    where accelerate runs one (or DeepSpeed's), else the weights' dtype.

    Read from the trainer's own attributes (its args, ``accelerator.native_amp``, HF's ``is_deepspeed_enabled``),
    never from accelerate's shared state, which a later trainer in the same process may have reset.
    """
    args = trainer.args
    weights = str(trainer.accelerator.unwrap_model(trainer.model).dtype).replace("torch.", "")
    mixed = getattr(args, "mixed_precision", None) or ("fp16" if args.fp16 else "bf16" if args.bf16 else "no")
    deepspeed = getattr(trainer, "is_deepspeed_enabled", False)  # DeepSpeed casts the module itself
    if mixed in ("fp16", "bf16") and (trainer.accelerator.native_amp or deepspeed):
        return mixed, f"{mixed} autocast over {weights} weights"
    why = f", mixed_precision={mixed} without autocast on {args.device.type}" if mixed != "no" else ""
    return precision_of_dtype(weights), f"{weights} weights{why}"


def refuse_trainer_precision(cfg: Any, trainer: Any) -> None:
    """``precision`` on a built trainer: it must already compute in that dtype (``apply`` cannot recast it)."""
    if cfg.precision is None:
        return
    found, how = trainer_precision(trainer)
    if found != cfg.precision:
        fp16, bf16 = MIXED_PRECISION[cfg.precision]
        raise ValueError(f"precision={cfg.precision!r} on a GRPOTrainer that computes in {found} ({how}): build it "
                         f"with ParityGRPOTrainer, or with fp16={fp16}, bf16={bf16} and weights in "
                         f"{' or '.join(load_dtypes(cfg.precision, trainer.args.device.type))}")


def check_engine_precision(cfg: Any, trainer: Any, engine: Any, mode: str) -> dict[str, bool]:
    """The engine's dtype (``engine``: as its config reports it) against the flag or, without it, the trainer's.

    With ``precision``: ``{"precision": held}``. Without: ``{}``, and one warning when trainer and engine compute
    in different dtypes (not refused: ``rollout-parity doctor`` measures what it costs).
    """
    found = precision_of_dtype(engine)
    if cfg.precision is not None:
        return {"precision": found == cfg.precision}
    trainer_side, how = trainer_precision(trainer)
    if found is not None and trainer_side is not None and found != trainer_side:
        logger.warning("rollout-parity: TRL's trainer computes in %s (%s) and its vLLM %s engine in %s: the two sides "
                       "round every logprob differently, a training-inference mismatch of its own. "
                       "`rollout-parity doctor` measures what it costs on your model (its p/mixed row); "
                       "precision=bf16|fp16|fp32 puts both sides in one dtype", trainer_side, how, mode,
                       engine_dtype(found))
    return {}
