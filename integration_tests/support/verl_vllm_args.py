"""Test support: the vLLM engine verl's rollout server would start, built by verl's own code (issue 31).

verl's config composed with the test's overrides (an fp8 rollout: ``actor_rollout_ref.rollout.quantization``,
the adapter's flags), validated and rewritten by the adapter's ``configure_verl`` (the driver's path); then
verl's own ``vLLMHttpServer`` (its ``__init__``, ``launch_server``: the engine kwargs, ``_apply_quantization``,
vLLM's CLI parser and its ``validate``) up to the point where it would start the server: its ``run_server`` is
the one thing replaced, by a function that keeps the parsed arguments. Those go through the first two lines of
verl's ``run_server``, vLLM's own ``AsyncEngineArgs.from_cli_args(args).create_engine_config(...)``, nothing
removed or rewritten; the CPU shims of ``verl_cpu`` stand in for the GPU machine. One JSON line, a result per run:
the ``hf_overrides`` vLLM received and what its config made of them, or the error that stopped the run.

A run given as ``{"gpu_argv": [overrides]}`` keeps verl's GPU defaults instead (sleep mode, CUDA graphs, the
model's length: none of the CPU settings above) and returns the ``vllm serve`` argv verl's ``launch_server``
builds (``support/verl_vllm_server.verl_serve_argv``), for ``vllm_config_check.check_serve`` to validate on a
GPU user's vLLM; it runs here because verl's fp8 rollout patches vLLM in the process that builds it.

Run in its own process: verl's fp8 rollout installs its vLLM patches process-wide
(``apply_vllm_quant_patches``). verl's server reads its Ray job id: a local Ray (one CPU, no dashboard) is started
after ``configure_verl`` with the job's runtime env, as verl's ``run_ppo`` starts it, and stopped after each run;
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps it and the ports verl's server reserves on 127.0.0.1.

    python -m integration_tests.support.verl_vllm_args '<JSON list of runs: each Hydra overrides, or {"gpu_argv": ...}>'
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


def main(runs: list) -> list[dict]:
    from .verl_cpu import ENV, install

    os.environ.update(ENV, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    install()  # [CPU SHIM 6] among them: verl finds vLLM under its CPU distribution's name
    return [_gpu_argv(run["gpu_argv"]) if isinstance(run, dict) else _run(run) for run in runs]


def _compose(overrides: list[str]):
    """verl's ``ppo_trainer`` config on the tiny model, vLLM as the rollout, with ``overrides``."""
    from rollout_parity.check.verl_checks import compose_verl
    from rollout_parity.testing.tiny_model import build_tiny_model

    return compose_verl(f"actor_rollout_ref.model.path={build_tiny_model()}", "actor_rollout_ref.rollout.name=vllm",
                        *overrides, base=False)


def _gpu_argv(overrides: list[str]) -> dict:
    from rollout_parity.adapters import verl as adapter

    from .verl_vllm_server import verl_serve_argv

    config = _compose(overrides)
    adapter.configure_verl(config)
    return {"argv": verl_serve_argv(config)}


def _run(overrides: list[str]) -> dict:
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from rollout_parity.adapters import verl as adapter

    config = _compose(["actor_rollout_ref.rollout.enforce_eager=true", "actor_rollout_ref.rollout.max_model_len=256",
                       "actor_rollout_ref.rollout.max_num_batched_tokens=256", *overrides])
    import ray
    from omegaconf import OmegaConf

    try:
        adapter.configure_verl(config)
        # as verl's run_ppo: Ray starts after the driver's configuration, with the job's runtime env
        ray.init(runtime_env=OmegaConf.to_container(config.ray_kwargs.ray_init.runtime_env), num_cpus=1,
                 include_dashboard=False)
        server = vLLMHttpServer(config.actor_rollout_ref.rollout, config.actor_rollout_ref.model,
                                RolloutMode.COLOCATED, workers=[], replica_rank=0, node_rank=0, gpus_per_node=1,
                                nnodes=1, cuda_visible_devices="0")
        parsed = {}

        async def keep_args(args):  # where verl would start vLLM's server
            parsed["args"] = args

        server.run_server = keep_args
        asyncio.run(server.launch_server())
        args = parsed["args"]
        vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
    except Exception as exc:  # noqa: BLE001 - the test reads the refusal
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        ray.shutdown()
    hf_config = vllm_config.model_config.hf_config
    quant = getattr(hf_config, "quantization_config", None)
    return {"error": None, "hf_overrides": args.hf_overrides, "quantization": vllm_config.model_config.quantization,
            "quantization_config": quant if isinstance(quant, dict) else None,
            "head_dtype": str(getattr(hf_config, "head_dtype", None)),
            "model_head_dtype": str(getattr(vllm_config.model_config, "head_dtype", None)),
            "logprobs_mode": str(vllm_config.model_config.logprobs_mode),
            "enable_prefix_caching": vllm_config.cache_config.enable_prefix_caching}


if __name__ == "__main__":
    print("RESULT_JSON " + json.dumps(main(json.loads(sys.argv[1]))))
