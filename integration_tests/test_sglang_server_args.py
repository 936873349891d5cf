"""verl with ``actor_rollout_ref.rollout.name=sglang`` and rollout-parity's flags: the server arguments verl's own
code builds pass SGLang's own validation with verl's GPU defaults, and with the GPU settings users run.

The arguments are verl's. verl's config is composed with the test's overrides and rewritten by the adapter
(``configure_verl``), verl's ``RolloutConfig`` / ``HFModelConfig`` are built from it, and verl 0.9.1's own statements
of ``SGLangHttpServer.launch_server`` (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``: from
``engine_kwargs = ...`` to just before ``server_args = ServerArgs(**args)``) are read from its installed source with
``ast`` and executed on a server object holding what verl's ``__init__`` sets on a single-node replica
(:func:`verl_server_args`). A change in verl changes the arguments. verl imports SGLang at module level and SGLang
cannot share this venv, so the server object is a namespace, not verl's class.

The SGLang is the release this suite can run (scripts/sglang_venv.sh: 0.5.23), while the arguments are those verl
builds on the release it pins (``verl[sglang]``: 0.5.12, read from verl's metadata): verl 0.9.1's launch stops on
SGLang >= 0.5.20 at ``dataclasses.fields(ServerArgs)`` (a msgspec Struct there; the adapter refuses that
combination, ``test_verl_sglang.py``). That statement runs on a dataclass of the venv's field names, as a 0.5.12
``ServerArgs`` would answer it.

The validation is SGLang's (``support/sglang_server_args.py``, in SGLang's venv): ``ServerArgs(**args)`` unchanged,
``resolve_once()`` and ``check_server_args()``, what ``Engine._launch_subprocesses`` runs before it spawns anything,
with only platform queries answering as a node of H100s (compute capability 9.0, 80 GB, CUDA 13, flashinfer
installed).
The gap: SGLang is imported on this CPU (its CUDA import paths need CUDA kernels) and made GPU-shaped afterwards;
the resolution modules freeze no platform fact at import (checked), modules outside them may, and nothing past
the checks (``_set_envs_and_config``, kernel loading, CUDA graph capture) runs. The device check for those is a
GPU run.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import json
import logging
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from rollout_parity.testing.stack import need

need("verl", extra="verl")

import torch  # noqa: E402
from packaging import version as packaging_version  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.net_utils import is_valid_ipv6_address  # noqa: E402
from verl.utils.tracking import RLInsightLogger  # noqa: E402
from verl.workers.config import HFModelConfig  # noqa: E402
from verl.workers.rollout.replica import RolloutMode  # noqa: E402
from verl.workers.rollout.sglang_rollout import utils as verl_sglang_utils  # noqa: E402

from rollout_parity.adapters import verl as adapter  # noqa: E402
from rollout_parity.adapters.verl import engine as verl_engine  # noqa: E402
from rollout_parity.engines.sglang import recipe as sglang_recipe  # noqa: E402
from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs  # noqa: E402
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

from .support.venvs import venv_python  # noqa: E402

from .support.verl_configs import compose_verl  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.verl]

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "integration_tests" / "support" / "sglang_server_args.py"
FLAGS = ("actor_rollout_ref.rollout.name=sglang", "+rollout_parity.rollout_importance_sampling_mode=token_truncate",
         "+rollout_parity.fp32_lm_head=true")
SGLANG_KWARG = "+actor_rollout_ref.rollout.engine_kwargs.sglang."
#: A vLLM rollout's recipe written for an SGLang rollout: the adapter mutation SGLang must refuse.
VLLM_RECIPE = "vllm_recipe"

#: Each case: Hydra overrides on top of FLAGS (verl's GPU defaults otherwise).
CASES: dict[str, tuple[str, ...]] = {
    "verl_defaults": (),
    "precision_fp16": ("+rollout_parity.precision=fp16",),
    "eager": ("actor_rollout_ref.rollout.enforce_eager=true",),
    "triton": (SGLANG_KWARG + "attention_backend=triton",),
    "fa3": (SGLANG_KWARG + "attention_backend=fa3",),
    "deterministic_flashinfer": (SGLANG_KWARG + "enable_deterministic_inference=true",),
    "deterministic_triton": (SGLANG_KWARG + "enable_deterministic_inference=true",
                             SGLANG_KWARG + "attention_backend=triton"),
    "deterministic_torch_native": (SGLANG_KWARG + "enable_deterministic_inference=true",
                                   SGLANG_KWARG + "attention_backend=torch_native"),
    "hierarchical_cache": (SGLANG_KWARG + "enable_hierarchical_cache=true",),
    VLLM_RECIPE: (),
}


def verl_pinned_sglang() -> str:
    """The SGLang release verl pins (its ``sglang`` extra), from verl's own metadata."""
    for requirement in importlib.metadata.requires("verl") or ():
        found = re.fullmatch(r'sglang==([\w.]+)\s*;\s*extra\s*==\s*"sglang"', requirement.strip())
        if found:
            return found.group(1)
    raise AssertionError("verl's metadata pins no sglang== for its sglang extra")


def _launch_server_statements():
    """verl's statements that build ``ServerArgs``' keywords, compiled from its installed source (its line numbers)."""
    import verl

    path = Path(verl.__file__).parent / "workers" / "rollout" / "sglang_rollout" / "async_sglang_server.py"
    tree = ast.parse(path.read_text(), str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SGLangHttpServer")
    launch = next(n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "launch_server")

    def assigns(stmt: ast.stmt, name: str) -> bool:
        return isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)

    starts = [i for i, s in enumerate(launch.body) if assigns(s, "engine_kwargs")]
    ends = [i for i, s in enumerate(launch.body) if assigns(s, "server_args")
            and ast.unparse(s.value).replace(" ", "") == "ServerArgs(**args)"]
    assert starts and ends and starts[0] < ends[0], \
        f"{path}: launch_server no longer reads engine_kwargs before server_args = ServerArgs(**args); re-read it"
    return compile(ast.Module(body=launch.body[starts[0]:ends[0]], type_ignores=[]), str(path), "exec")


def verl_server_args(overrides: tuple[str, ...], *, fields: list[str], sglang_version: str) -> dict:
    """The ``ServerArgs(**args)`` keywords and environment of verl 0.9.1's SGLang server for these overrides.

    The server object carries what ``SGLangHttpServer.__init__`` sets, on the node ``SGLangReplica.launch_servers``
    starts for a single-node replica in verl's default (hybrid) training (its GPUs: the rollout's
    tensor_model_parallel_size, 2 by default): the ``RolloutConfig`` and
    ``HFModelConfig`` built by ``omega_conf_to_dataclass`` as there, ``rollout_mode`` HYBRID (``init_hybrid``,
    verl/workers/rollout/replica.py), ``node_rank`` 0, ``nnodes`` 1, ``base_gpu_id`` 0, no disaggregation role, and
    ``lora_as_adapter`` from verl's own ``lora_served_as_adapter``. Not set: the ``max_model_len`` default
    ``__init__`` writes and the profiler, which these statements do not read; the server address (a Ray lookup)
    is only read with disaggregation.
    """
    config = compose_verl(*FLAGS, f"actor_rollout_ref.model.path={build_tiny_model()}", *overrides)
    try:
        adapter.configure_verl(config)
    finally:
        adapter.set_active_config(None)
    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    server = SimpleNamespace(
        config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout), model_config=model_config,
        rollout_mode=RolloutMode.HYBRID, node_rank=0, nnodes=1, base_gpu_id=0, replica_rank=0,
        _disaggregation_role="null", _disaggregation_bootstrap_port=None, _master_address=None, _master_port=None,
        _server_address="127.0.0.1", lora_as_adapter=verl_sglang_utils.lora_served_as_adapter(model_config))
    environ: dict = {}
    namespace = {
        "self": server, "json": json, "torch": torch, "version": packaging_version,  # torch.version.hip: None (CUDA)
        "sglang": SimpleNamespace(__version__=sglang_version,
                                  srt=SimpleNamespace(entrypoints=SimpleNamespace(engine=SimpleNamespace()))),
        # ServerArgs as verl's pin has it (a dataclass), with the field names of the SGLang under test
        "dataclasses": dataclasses, "ServerArgs": dataclasses.make_dataclass("ServerArgs", fields),
        # the process environment verl's server sets for SGLang: handed to the SGLang process
        "os": SimpleNamespace(environ=environ),
        # verl swaps SGLang's _set_envs_and_config for its own (sglang_rollout.py); not run here (module doc)
        "_set_envs_and_config": None,
        "RolloutMode": RolloutMode, "RLInsightLogger": RLInsightLogger, "is_valid_ipv6_address": is_valid_ipv6_address,
        "lora_rank_of": verl_sglang_utils.lora_rank_of,
        "sglang_lora_target_modules": verl_sglang_utils.sglang_lora_target_modules,
        "logger": logging.getLogger("verl.workers.rollout.sglang_rollout.async_sglang_server"),
    }
    exec(_launch_server_statements(), namespace)  # noqa: S102 - verl's own statements, read from its source
    return {"args": namespace["args"], "env": environ}


@pytest.fixture(scope="module")
def sglang_python() -> str:
    return venv_python("sglang_venv.sh", "SGLang venv (sglang 0.5.23 on the CPU torch)")


def _run_support(python: str, *argv: str) -> dict:
    proc = subprocess.run([python, str(SUPPORT), *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(Path(argv[-1]).read_text())


@pytest.fixture(scope="module")
def sglang_fields(sglang_python, tmp_path_factory) -> dict:
    return _run_support(sglang_python, "--fields", str(tmp_path_factory.mktemp("sglang_fields") / "fields.json"))


@pytest.fixture(scope="module")
def built(sglang_fields) -> dict:
    """Each case's arguments, built by verl's code (one SGLang process validates them all)."""
    pin = verl_pinned_sglang()
    out = {}
    for name, overrides in CASES.items():
        if name == VLLM_RECIPE:
            def vllm_recipe(engine, cfg, *, precision=None):  # the mutation: vLLM's recipe whatever the engine
                return vllm_parity_kwargs(fp32_lm_head=cfg.fp32_lm_head, precision=precision)

            with mock.patch.object(verl_engine, "engine_recipe", vllm_recipe):
                out[name] = verl_server_args(overrides, fields=sglang_fields["fields"], sglang_version=pin)
        elif name == "hierarchical_cache":  # the adapter refuses it first (test_verl_sglang.py): SGLang's own word
            with mock.patch.object(sglang_recipe, "refuse_contradictions", lambda *a, **k: None):
                out[name] = verl_server_args(overrides, fields=sglang_fields["fields"], sglang_version=pin)
        else:
            out[name] = verl_server_args(overrides, fields=sglang_fields["fields"], sglang_version=pin)
    return out


@pytest.fixture(scope="module")
def validated(sglang_python, built, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sglang_server_args")
    (root / "args.json").write_text(json.dumps({"cases": built}))
    return _run_support(sglang_python, str(root / "args.json"), str(root / "out.json"))


def resolved(validated: dict, name: str) -> dict:
    case = validated["cases"][name]
    assert case["error"] is None, f"{name}: SGLang refused verl's arguments at {case['stage']}: {case['error']}\n" \
                                  f"{case.get('traceback', '')}"
    return case["resolved"]


def test_the_platform_is_gpu_shaped(validated, sglang_fields):
    assert validated["platform"] == {"is_cuda": True, "is_hip": False, "is_sm90": True, "is_sm100": False,
                                     "device_sm": 90, "has_flashinfer": True, "device": "cuda",
                                     "memory_mib": 80 * 1024}
    assert validated["import_time_flags"] == [], "resolution code froze a platform fact at import (module doc)"
    # verl 0.9.1 reads ServerArgs with dataclasses.fields: the premise for building its arguments as on its pin
    assert not sglang_fields["is_dataclass"] and "enable_weights_cpu_backup" in sglang_fields["fields"]


def test_verls_gpu_defaults_and_our_flags_pass_sglangs_validation(built, validated):
    args = built["verl_defaults"]["args"]
    # verl's own GPU defaults, as its launch_server writes them, with the recipe spread in from engine_kwargs.sglang
    assert (args["attention_backend"], args["disable_cuda_graph"], args["dtype"]) == ("flashinfer", False, "bfloat16")
    assert args["enable_weights_cpu_backup"] is True and args["enable_memory_saver"] is True
    assert built["verl_defaults"]["env"] == {"SGLANG_BLOCK_NONZERO_RANK_CHILDREN": "0"}
    got = resolved(validated, "verl_defaults")
    assert {k: got[k] for k in ("enable_fp32_lm_head", "disable_radix_cache", "disable_overlap_schedule", "dtype")} \
        == {"enable_fp32_lm_head": True, "disable_radix_cache": True, "disable_overlap_schedule": True,
            "dtype": "bfloat16"}, "a recipe key did not survive SGLang's resolution"
    assert (got["device"], got["attention_backend"], got["sampling_backend"]) == ("cuda", "flashinfer", "flashinfer")
    assert got["disable_cuda_graph"] is False and got["cuda_graph_config"]["decode"]["backend"] != "disabled"
    assert got["enable_weights_cpu_backup"] is True and got["skip_tokenizer_init"] is True


def test_the_precision_flag_reaches_sglangs_dtype(validated):
    assert resolved(validated, "precision_fp16")["dtype"] == "float16"
    assert resolved(validated, "verl_defaults")["dtype"] == "bfloat16"


@pytest.mark.parametrize("name, backend, cuda_graphs", [
    ("verl_defaults", "flashinfer", True),
    ("eager", "flashinfer", False),
    ("triton", "triton", True),
    ("fa3", "fa3", True),
])
def test_gpu_settings_users_run_resolve(validated, name, backend, cuda_graphs):
    got = resolved(validated, name)
    assert got["attention_backend"] == backend
    assert got["disable_cuda_graph"] is (not cuda_graphs)
    assert (got["cuda_graph_config"]["decode"]["backend"] != "disabled") is cuda_graphs
    assert got["disable_radix_cache"] is True and got["disable_overlap_schedule"] is True


@pytest.mark.parametrize("name, backend", [("deterministic_flashinfer", "flashinfer"),
                                           ("deterministic_triton", "triton")])
def test_deterministic_inference_resolves_with_pytorch_sampling(validated, name, backend):
    got = resolved(validated, name)
    assert got["enable_deterministic_inference"] is True and got["attention_backend"] == backend
    assert got["sampling_backend"] == "pytorch", "SGLang forces pytorch sampling for deterministic inference"
    assert got["enable_fp32_lm_head"] is True and got["disable_radix_cache"] is True


@pytest.mark.parametrize("name, stage, message", [
    # a backend outside SGLang's deterministic list, asked for by the user
    ("deterministic_torch_native", "resolve",
     r"ValueError: Currently only .* attention backends are supported for deterministic inference, "
     r"but you explicitly specified 'torch_native'"),
    # the user's hierarchical cache against the recipe's prefix cache off (the adapter refuses it first, by name)
    ("hierarchical_cache", "resolve",
     r"ValueError: The arguments enable-hierarchical-cache and disable-radix-cache are mutually exclusive"),
    # the mutation: vLLM's recipe written for an SGLang rollout is refused at construction
    (VLLM_RECIPE, "construct",
     r"TypeError: Unexpected keyword argument '(logprobs_mode|enable_prefix_caching|async_scheduling|hf_overrides)'"),
])
def test_what_sglang_refuses_is_refused_by_sglang(built, validated, name, stage, message):
    case = validated["cases"][name]
    assert case["error"] is not None, f"{name}: SGLang accepted {built[name]['args']}"
    assert case["stage"] == stage and re.match(message, case["error"]), case["error"]
