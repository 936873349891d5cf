"""Test support: run verl 0.9.1's own FSDP actor on CPU (gloo), never used by the package.

verl 0.9.1 has no CPU platform: on a CPU-only machine ``get_device_name()`` is ``"cuda"``
and the FSDP engine calls the CUDA device module. verl does let a plugin register a
platform (``PlatformRegistry.register``, selected with ``VERL_PLATFORM``) and pick an engine
class for it (``VERL_ENGINE_DEVICE``/``VERL_ENGINE_VENDOR``); this module registers a
``cpu`` platform whose device module is a no-op stand-in for ``torch.cuda``, so
``FSDPEngineWithLMHead`` builds, shards (FSDP2 over a one-rank gloo group), runs
forward/backward and steps on CPU. Import it before anything asks verl for its platform,
with the environment of :data:`ENV` set.

One more workaround, for a verl 0.9.1 / trl 1.16 incompatibility rather than for CPU:
verl's ``apply_monkey_patch`` imports ``AutoModelForCausalLMWithValueHead`` from TRL when
TRL is installed, and TRL 1.16 no longer ships it, so building any FSDP actor fails with
both installed. :func:`install` makes verl's ``is_trl_available`` false in this process.
"""

from __future__ import annotations

import contextlib
import types

import torch

ENV = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "VERL_ENGINE_VENDOR": "nvidia"}


def _noop(*args, **kwargs):
    return None


CPU_DEVICE_MODULE = types.SimpleNamespace(
    is_available=lambda: True, current_device=lambda: "cpu", device_count=lambda: 1, set_device=_noop,
    synchronize=_noop, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, empty_cache=_noop,
    memory_allocated=lambda *a, **k: 0, memory_reserved=lambda *a, **k: 0, max_memory_allocated=lambda *a, **k: 0,
    max_memory_reserved=lambda *a, **k: 0, mem_get_info=lambda *a, **k: (1 << 34, 1 << 34),
    reset_peak_memory_stats=_noop, get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
    get_device_name=lambda *a, **k: "CPU", is_initialized=lambda: True, current_stream=lambda *a, **k: None,
)


def install() -> None:
    """Register the ``cpu`` platform with verl and apply the TRL workaround (idempotent)."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get("cpu") is None:

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
                return "CPU_VISIBLE_DEVICES"

            def ray_resource_name(self):
                return "CPU"

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

    import verl.models.transformers.monkey_patch as monkey_patch

    monkey_patch.is_trl_available = lambda: False
