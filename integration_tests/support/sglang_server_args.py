"""Test support, run inside SGLang's venv (scripts/sglang_venv.sh): SGLang's own validation of server arguments on a
GPU-shaped platform (a node of H100s), for ``integration_tests/test_sglang_server_args.py``.

    python sglang_server_args.py --fields OUT.json      # ServerArgs' field names (what verl's launch_server reads)
    python sglang_server_args.py ARGS.json OUT.json     # {"cases": {name: {"args": {...}, "env": {...}}}}

Each case: ``ServerArgs(**args)`` unchanged, then what ``Engine._launch_subprocesses`` runs on it before anything
spawns (sglang 0.5.23 ``entrypoints/engine.py``): ``server_args.resolve_once()`` (the resolution pipeline,
``arg_groups/pipeline.py``) and ``server_args.check_server_args()``. Reported: the resolved values
(``ServerArgs.resolved_dict()``: 0.5.23 resolves into declarations and never writes the record) of the keys the
test reads, or the error that stopped the case and the stage it stopped in. Not run: ``_set_envs_and_config``
(process environment and installed-kernel version checks; verl replaces it with its own), ``load_plugins``,
``resolve_auto_parsers`` (chat/tool parser detection) and ``publish`` (projection of the resolved record).
Each case runs in a forked child: resolution writes process environment (NCCL_*, SGLANG_*) that must not leak
into the next case.

The platform. SGLang is imported on the machine it is on (this CPU): importing it with CUDA reported would take its
CUDA kernel paths at import (``from sgl_kernel import int8_scaled_mm`` under ``if _is_cuda``), which the CPU
stand-in of sgl_kernel does not have. Then only platform queries are made to answer as on a node of eight H100 80GB
(verl's ``trainer.n_gpus_per_node`` default) with SGLang's CUDA 13 build, before any case is built
(:func:`gpu_platform`):

* ``torch.cuda.is_available`` -> True, ``torch.version.cuda`` -> "13.0" (sglang 0.5.23 requires cuda-python>=13;
  ``utils.common.is_cuda`` reads both), ``torch.cuda.device_count`` -> 8, ``torch.cuda.get_device_capability`` ->
  (9, 0) (read directly by the attention hooks and by ``get_device_sm`` once NVML finds no driver),
  ``torch.cuda.get_device_name`` -> an H100's, ``torch.cuda.mem_get_info`` -> 80 GiB free of 80 GiB (what
  ``get_nvgpu_memory_capacity`` falls back to without nvidia-smi).
* the ``lru_cache`` of ``sglang.srt.utils.common``'s probes cleared: they were first evaluated during the CPU import.
* ``override_platform(has_flashinfer=True)``, SGLang's own switch for its platform facts
  (``runtime_context.override_platform``): flashinfer is a CUDA-only dependency of sglang that a GPU install has
  and this CPU venv cannot hold (it picks the default sampling backend).

Nothing else: ``ServerArgs``, its fields, its resolution and its validation are SGLang's, unpatched. Resolution
code that froze a platform fact at import would still see the CPU: module globals of ``sglang.srt.arg_groups``
named like a platform fact are reported (``import_time_flags``) for the test to check there are none.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pkgutil
import re
import sys
import traceback
from typing import Any

#: The GPU the platform answers as.
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
CAPABILITY = (9, 0)
MEMORY_BYTES = 80 * 2**30
CUDA = "13.0"
DEVICES = 8

#: Resolved values the test reads (resolved_dict keys).
REPORTED = ("enable_fp32_lm_head", "disable_radix_cache", "disable_overlap_schedule", "dtype", "attention_backend",
            "disable_cuda_graph", "cuda_graph_config", "device", "sampling_backend", "enable_deterministic_inference",
            "enable_hierarchical_cache", "tp_size", "mem_fraction_static", "enable_memory_saver",
            "enable_weights_cpu_backup", "skip_tokenizer_init", "load_format", "max_running_requests")


def _import_sglang() -> Any:
    """SGLang's server arguments and every resolution module, imported on this (CPU) machine."""
    import sglang
    import sglang.srt.arg_groups as groups
    from sglang.srt.server_args import ServerArgs

    for module in pkgutil.walk_packages(groups.__path__, groups.__name__ + "."):
        importlib.import_module(module.name)
    return sglang, ServerArgs


#: How SGLang names a platform fact it keeps in a module global (``_is_cuda = is_cuda()``, ``_device_sm``, ...).
PLATFORM_NAME = re.compile(r"cuda|hip|npu|xpu|musa|mps|sm\d|blackwell|hopper|flashinfer|aiter|amx|cpu|gpu|device",
                           re.IGNORECASE)


def _import_time_flags() -> list[str]:
    """Platform facts the resolution modules froze at import (none expected): module globals named like one and
    holding a plain value (UPPER_CASE constants left out)."""
    import sglang.srt.arg_groups as groups

    found = []
    for module in pkgutil.walk_packages(groups.__path__, groups.__name__ + "."):
        for name, value in vars(sys.modules[module.name]).items():
            if isinstance(value, (bool, int, str, tuple)) and not name.isupper() and not name.startswith("__") \
                    and PLATFORM_NAME.search(name):
                found.append(f"{module.name}.{name}")
    return found


def gpu_platform() -> dict:
    """Make SGLang's platform queries answer as a node of H100s (module doc); returns what SGLang then reports."""
    import torch
    from sglang.srt.runtime_context import get_platform, override_platform
    from sglang.srt.utils import common

    torch.cuda.is_available = lambda: True
    torch.version.cuda = CUDA
    torch.cuda.device_count = lambda: DEVICES
    torch.cuda.get_device_capability = lambda device=None: CAPABILITY
    torch.cuda.get_device_name = lambda device=None: DEVICE_NAME
    torch.cuda.mem_get_info = lambda device=None: (MEMORY_BYTES, MEMORY_BYTES)
    for value in vars(common).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    override_platform(has_flashinfer=True).install()
    facts = get_platform()
    return {"is_cuda": facts.is_cuda, "is_hip": facts.is_hip, "is_sm90": facts.is_sm90, "is_sm100": facts.is_sm100,
            "device_sm": facts.device_sm, "has_flashinfer": facts.has_flashinfer, "device": common.get_device(),
            "memory_mib": common.get_device_memory_capacity("cuda")}


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _case(server_args_cls: Any, case: dict) -> dict:
    """One argument set through construction, resolution and SGLang's check, as _launch_subprocesses runs them."""
    os.environ.update(case.get("env") or {})
    stage = "construct"
    try:
        server_args = server_args_cls(**case["args"])
        stage = "resolve"
        server_args.resolve_once()
        stage = "check"
        server_args.check_server_args()
    except Exception as exc:  # noqa: BLE001 - the test reads SGLang's refusal
        return {"error": f"{type(exc).__name__}: {exc}", "stage": stage,
                "traceback": traceback.format_exc()[-3000:]}
    resolved = server_args.resolved_dict()
    return {"error": None, "stage": None, "resolved": {k: _jsonable(resolved.get(k)) for k in REPORTED}}


def _forked(server_args_cls: Any, case: dict) -> dict:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one case, its answer down the pipe
        os.close(read)
        try:
            out = json.dumps(_case(server_args_cls, case)).encode()
        except BaseException as exc:  # noqa: BLE001
            out = json.dumps({"error": f"{type(exc).__name__}: {exc}", "stage": "child"}).encode()
        with os.fdopen(write, "wb") as pipe:
            pipe.write(out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    return json.loads(data) if data else {"error": f"child exited with status {status}", "stage": "child"}


def main(argv: list[str]) -> dict:
    sglang, server_args_cls = _import_sglang()
    if argv[0] == "--fields":
        import msgspec

        fields = [f.name for f in (dataclasses.fields(server_args_cls) if dataclasses.is_dataclass(server_args_cls)
                                   else msgspec.structs.fields(server_args_cls))]
        return {"version": sglang.__version__, "fields": fields,
                "is_dataclass": dataclasses.is_dataclass(server_args_cls)}
    with open(argv[0]) as f:
        cases = json.load(f)["cases"]
    import logging

    logging.disable(logging.WARNING)  # resolution warns freely; the answer is the result
    platform = gpu_platform()
    return {"version": sglang.__version__, "platform": platform, "import_time_flags": _import_time_flags(),
            "cases": {name: _forked(server_args_cls, case) for name, case in cases.items()}}


if __name__ == "__main__":
    result = main(sys.argv[1:-1])
    with open(sys.argv[-1], "w") as f:
        json.dump(result, f, indent=1)
