"""v0.7 ``nemo_rl/algorithms/loss/interfaces.py``: the loss protocol and its two enums."""

import enum
from typing import Any, Protocol

import torch


class LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossInputType(enum.Enum):
    LOGIT = "logit"
    LOGPROB = "logprob"
    DISTILLATION = "distillation"
    DISTILLATION_CROSS_TOKENIZER = "distillation_cross_tokenizer"
    DRAFT = "draft"


class LossFunction(Protocol):
    """A loss: two attributes and a call returning ``(scalar loss, metrics dict)``.

    The trainer calls it with keywords: ``data``, ``global_valid_seqs``,
    ``global_valid_toks`` and, for ``LossInputType.LOGPROB``, ``next_token_logprobs``.
    """

    loss_type: LossType
    input_type: LossInputType

    def __call__(self, data: Any, global_valid_seqs: torch.Tensor,
                 global_valid_toks: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, dict]:
        ...
