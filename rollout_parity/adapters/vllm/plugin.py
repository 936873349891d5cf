"""rollout-parity's vLLM plugin: the ``vllm.general_plugins`` entry point ``rollout_parity``.

vLLM calls :func:`register` once in every process it starts or runs in: the caller's (when it
builds an ``EngineArgs`` config), the engine core's, each worker's, and ``vllm serve``'s
(``vllm/plugins/__init__.py``, ``load_general_plugins``; the same hook in 0.20 through 0.32).
It does two things there, neither of which changes an engine that does not ask:

* on vLLM < 0.26 (which runs a generation model's head in the model dtype whatever
  ``hf_overrides["head_dtype"]`` says), it wraps ``LogitsProcessor.__init__`` so that a model built
  for a config asking ``head_dtype=float32`` projects its head in fp32 (``fp32_head.py``);
* on every vLLM, it adds the worker method ``rollout_parity_head_report``, through which
  ``verify_engine`` reads the head from the processes that run the model (``head_report.py``).

A plugin that raised would stop every vLLM engine of the environment, so :func:`register` never
raises: a failure is logged as a warning on vLLM's logger, and ``verify_engine`` then reports the
fp32 head as not held. ``VLLM_PLUGINS`` (a comma-separated allow-list) without ``rollout_parity``
keeps vLLM from calling it at all; the recipe refuses ``fp32_lm_head`` there on vLLM < 0.26.
"""

from __future__ import annotations

from rollout_parity.adapters.vllm.fp32_head import apply_fp32_head_on_request, logger
from rollout_parity.adapters.vllm.head_report import install_head_report
from rollout_parity.engines.vllm.features import vllm_has

__all__ = ["register", "needs_fp32_head_patch"]


def needs_fp32_head_patch(version: str) -> bool:
    """Whether vLLM ``version`` ignores ``head_dtype`` for generation models (< 0.26)."""
    return not vllm_has("head_dtype", version)


def register() -> None:
    """Entry point: install both pieces in this process; log, never raise, on failure."""
    try:
        import vllm

        version = vllm.__version__
    except Exception as exc:  # noqa: BLE001
        logger.warning("rollout-parity's vLLM plugin did nothing: vLLM did not import (%s)", exc)
        return
    steps = [("the engine head report for verify_engine", install_head_report)]
    if needs_fp32_head_patch(version):
        steps.append(("the fp32 head for engines asking hf_overrides head_dtype=float32",
                      apply_fp32_head_on_request))
    for what, install in steps:
        try:
            install()
        except Exception as exc:  # noqa: BLE001 - never stop the user's engine
            logger.warning("rollout-parity's vLLM plugin could not install %s on vLLM %s: %s: %s",
                           what, version, type(exc).__name__, exc)
