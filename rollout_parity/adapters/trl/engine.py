"""TRL's vLLM engine on the parity recipe: colocated engines built with it, servers checked against it.

:func:`parity_vllm_engine` wraps the ``LLM`` global of ``trl.generation.vllm_generation`` while TRL
builds its colocated engine (:func:`colocated_engine_kwargs`: ``vllm_parity_kwargs`` merged over TRL's kwargs,
each change logged; :func:`engine_options` reads its options from the flags);
:func:`server_command` prints the ``trl vllm-serve`` line of the recipe; :func:`check_engine` reads
the engine's resolved settings at ``apply`` and refuses raw logprobs. docs/trl_vllm.md, "Parity in TRL's vLLM".
"""

from __future__ import annotations

import contextlib
import logging
import shlex
from typing import Any, Iterator, Mapping, Optional

from rollout_parity.adapters._patching import patched
from rollout_parity.adapters._refusals import needs_rollout_logprobs
from rollout_parity.adapters.trl.precision import check_engine_precision
from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.precision import engine_dtype

__all__ = ["engine_options", "colocated_engine_kwargs", "parity_vllm_engine", "server_command", "check_engine"]

logger = logging.getLogger(__name__)


def engine_options(cfg: CorrectionConfig) -> dict[str, Any]:
    """:func:`parity_vllm_engine`'s options for the flags ``cfg``.

    ``moe_routing_replay`` asks vLLM for routed experts, which vLLM returns only with prefix caching on: the
    cache policy is then ``reset``. TRL resets its colocated engine's prefix cache after every weight sync
    (``VLLMGeneration.sync_weights``) and the adapter's sync wrapper checks that the reset took (``sync.py``),
    so no prefix cached under old weights is served after an update (docs/moe_routing_replay.md, "Routing replay").
    ``precision`` becomes the engine's ``dtype`` (``precision.py``).
    """
    return {"fp32_lm_head": cfg.fp32_lm_head, "prefix_cache_policy": "reset" if cfg.moe_routing_replay else "off",
            "return_routed_experts": cfg.moe_routing_replay, "sampling_replay": cfg.rollout_sampling_replay,
            "precision": cfg.precision}


def colocated_engine_kwargs(trl_kwargs: Mapping[str, Any], fp32_lm_head: bool = False,
                            prefix_cache_policy: str = "off", return_routed_experts: bool = False,
                            sampling_replay: bool = False, precision: Optional[str] = None) -> dict[str, Any]:
    """The kwargs TRL's colocated ``vllm.LLM`` is built with: TRL's own ``trl_kwargs`` with the parity recipe
    over them (``vllm_parity_kwargs``; the recipe wins, ``hf_overrides`` merge). With ``return_routed_experts``
    also vLLM's ``enable_return_routed_experts`` (which needs ``prefix_cache_policy`` other than ``off``); with
    ``precision`` the engine's ``dtype`` (TRL passes none: vLLM's ``auto``, the checkpoint's)."""
    from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs

    recipe = vllm_parity_kwargs(fp32_lm_head=fp32_lm_head, prefix_cache_policy=prefix_cache_policy,
                                sampling_replay=sampling_replay, routed_experts=return_routed_experts,
                                precision=precision)
    merged = {**trl_kwargs, **recipe}
    if "hf_overrides" in recipe:
        merged["hf_overrides"] = {**(trl_kwargs.get("hf_overrides") or {}), **recipe["hf_overrides"]}
    return merged


@contextlib.contextmanager
def parity_vllm_engine(fp32_lm_head: bool = False, prefix_cache_policy: str = "off",
                       return_routed_experts: bool = False, sampling_replay: bool = False,
                       precision: Optional[str] = None) -> Iterator[dict]:
    """Build TRL's colocated ``vllm.LLM`` with :func:`colocated_engine_kwargs` while the block runs.

    Yields a dict that gets the final kwargs under ``"kwargs"``. Conflicting options (routed experts without
    a prefix cache) raise before TRL builds anything. Nested blocks leave the outer one's wrapper.
    """
    from trl.generation import vllm_generation

    from rollout_parity.engines.vllm.names import check_vllm_names

    options = dict(fp32_lm_head=fp32_lm_head, prefix_cache_policy=prefix_cache_policy,
                   return_routed_experts=return_routed_experts, sampling_replay=sampling_replay, precision=precision)
    colocated_engine_kwargs({}, **options)  # refuse what cannot be built before TRL loads a model
    built: dict[str, Any] = {}
    if getattr(vllm_generation, "LLM", None) is None:  # no vLLM: TRL raises its own error
        yield built
        return
    check_vllm_names()  # every vLLM-internal name the adapter reaches, before TRL builds the engine

    def with_recipe(original: Any, *args: Any, **kwargs: Any) -> Any:
        merged = colocated_engine_kwargs(kwargs, **options)
        changed = [f"{k}: {kwargs.get(k)!r} -> {merged[k]!r}" for k in merged if kwargs.get(k) != merged[k]]
        if changed:
            logger.info("rollout-parity: TRL's vLLM engine built with the parity recipe: %s", ", ".join(changed))
        built["kwargs"] = merged
        return original(*args, **merged)

    with patched(vllm_generation, "LLM", with_recipe, dotted="trl.generation.vllm_generation.LLM"):
        yield built


def server_command(model: str, fp32_lm_head: bool = False, prefix_cache_policy: str = "off",
                   extra_args: Optional[list[str]] = None, precision: Optional[str] = None) -> str:
    """The ``trl vllm-serve`` command that serves ``model`` with the parity recipe (TRL forwards
    what it does not know to ``vllm serve``; it adds ``--logprobs-mode processed_logprobs`` itself).
    ``precision``: ``--dtype`` (TRL's own option, handed to ``vllm serve``)."""
    from rollout_parity.engines.vllm.recipe import vllm_serve_flags

    flags = vllm_serve_flags(fp32_lm_head, prefix_cache_policy, style="trl", precision=precision)
    return shlex.join(["trl", "vllm-serve", "--model", str(model), *flags, *(extra_args or [])])


def _server_checks(generation: Any, cfg: CorrectionConfig) -> tuple[dict[str, bool], Any]:
    """The recipe's checks on the server's resolved configuration, and its model dtype (``torch.bfloat16``)."""
    client = generation.vllm_client
    info = client.get_server_info() if hasattr(client, "get_server_info") else client._get(  # TRL 1.15
        f"{client.base_url}/server_info", params={"config_format": "json"})["vllm_config"]
    model = info["model_config"]
    checks = {"logprobs_mode": model.get("logprobs_mode") == "processed_logprobs",
              "async_scheduling_off": not info["scheduler_config"].get("async_scheduling"),
              "prefix_caching_off": not info["cache_config"].get("enable_prefix_caching")}
    if cfg.fp32_lm_head:
        head = model.get("head_dtype") or (model.get("hf_overrides") or {}).get("head_dtype") or model["dtype"]
        checks["fp32_lm_head"] = str(head).replace("torch.", "") in ("float32", "fp32")
    return checks, model.get("dtype")


def check_engine(trainer: Any, cfg: CorrectionConfig) -> Optional[dict[str, bool]]:
    """TRL's vLLM (colocated, or a server via TRL's client) against the recipe: warn; raise for raw logprobs and
    for an engine in another dtype than ``precision`` (without it, a dtype unlike the trainer's is a warning)."""
    generation, mode = getattr(trainer, "vllm_generation", None), getattr(trainer, "vllm_mode", None)
    if not trainer.use_vllm or generation is None or not trainer.accelerator.is_main_process:
        return None
    try:
        if mode == "server":
            checks, dtype = _server_checks(generation, cfg)
        else:
            from rollout_parity.engines.vllm.recipe import verify_engine

            checks = verify_engine(generation.llm, fp32_lm_head=cfg.fp32_lm_head,
                                   prefix_cache_policy=engine_options(cfg)["prefix_cache_policy"])
            dtype = generation.llm.llm_engine.vllm_config.model_config.dtype  # TRL's own path to the engine
    except Exception as exc:  # noqa: BLE001 - e.g. a server without /server_info: say so, do not guess
        logger.warning("rollout-parity: could not read TRL's vLLM %s configuration (%s): recipe unverified", mode, exc)
        return None
    checks.update(check_engine_precision(cfg, trainer, dtype, mode))
    failed = [k for k, ok in checks.items() if not ok]
    fix = lambda: server_command(trainer.model.name_or_path, fp32_lm_head=cfg.fp32_lm_head,  # noqa: E731
                                 precision=cfg.precision)
    if "logprobs_mode" in failed and needs_rollout_logprobs(cfg):
        raise ValueError(f"TRL's vLLM {mode} engine returns raw logprobs, not processed_logprobs: r_corr would carry "
                         "the sampler's temperature and truncation as mismatch (--logprobs-mode processed_logprobs)")
    if "precision" in failed:
        raise ValueError(f"precision={cfg.precision!r}: TRL's vLLM {mode} engine computes in "
                         f"{str(dtype).replace('torch.', '')}, the trainer in {engine_dtype(cfg.precision)}; "
                         + ("serve with: " + fix() if mode == "server" else
                            "build the trainer with ParityGRPOTrainer (it gives the engine the dtype)"))
    if failed:
        logger.warning("rollout-parity: TRL's vLLM %s engine misses the parity recipe (%s); use ParityGRPOTrainer "
                       "(colocate) or serve with: %s", mode, ", ".join(failed), fix())
    return checks
