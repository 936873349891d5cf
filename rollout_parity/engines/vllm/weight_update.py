"""In-flight weight updates for a vLLM engine, and the prefix-cache policy across them.

Source: ../shared/seeds/pipelinerl-vllm-v1-parity.txt ("Inflight Weight Updates"): the V1
analogue of what V0 did is

    await engine.pause_generation(mode="keep", clear_cache=False)
    await <load the new weights>            # e.g. collective_rpc("receive_weight_update", ...)
    await engine.resume_generation()

``keep`` freezes in-flight requests and resumes them afterwards (V0's behaviour);
``clear_cache=False`` leaves cached state alone, as V0's wrapper did. The resume sits in a
``finally`` so a failed load never leaves the engine paused.

A prefix-cache hit after a load would reuse KV computed under the old weights (vllm#9744), so
when prefix caching stays on a policy guards it:

- ``off``: the recipe's default; the engine runs without a prefix cache, nothing to guard.
- ``reset``: reset the prefix cache after each load. Requests frozen in flight are preempted
  and recompute their KV under the new weights (vLLM cannot drop blocks still in use
  otherwise), so every token they sample after the load is the new weights' exactly.
- ``salt``: every request carries ``cache_salt`` = the weight version it started under (as
  prime-rl does), so a request started after the load never matches a block cached before
  it, and the cache keeps its speed. Stamp prompts with :meth:`WeightVersion.stamp`.

Under ``salt`` and ``off`` a request frozen in flight keeps its *own* KV: its later tokens
come from the new weights reading KV its earlier tokens left under the old ones (V0's
in-flight semantics, which ``keep`` + ``clear_cache=False`` reproduce). Measured on vLLM 0.31
CPU (``integration_tests/test_vllm_async_update.py``, new weights of another seed): after the
load such tokens differ from an engine started fresh on the new weights by ~6e-2 per token
(the gap grows with the size of the update), under ``reset`` by ~2e-7.

Loading: ``load`` may name a worker method. vLLM >= 0.31's ``reload_weights`` loads HF-named
tensors (``load_kwargs={"weights_iterator": [(name, tensor), ...]}``, in-process engines) or a
checkpoint directory (``{"weights_path": path}``) and re-runs each layer's post-load
processing, so it also works with vLLM's repacked CPU weights::

    await update_weights_in_flight(engine, "reload_weights", load_kwargs={"weights_path": path},
                                   prefix_cache_policy="reset")

Engines are duck-typed (``AsyncLLM`` for the async helper, ``vllm.LLM`` for the sync one):
this module never imports vLLM.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Awaitable, Callable, Union

from rollout_parity.engines.spec import normalize_prefix_cache_policy

__all__ = [
    "WeightVersion",
    "update_weights_in_flight",
    "update_weights_sync",
    "salt_for_version",
]

Loader = Union[str, Callable[[], Any], Callable[[], Awaitable[Any]]]


def salt_for_version(version: int, prefix: str = "rollout-parity-weights-v") -> str:
    """The ``cache_salt`` string of a weight version."""
    return f"{prefix}{int(version)}"


class WeightVersion:
    """A thread-safe weight-version counter that stamps requests with ``cache_salt``.

    vLLM takes the salt on the prompt (``{"prompt": ..., "cache_salt": ...}`` or
    ``{"prompt_token_ids": [...], "cache_salt": ...}``; ``SamplingParams`` has no salt
    field), or as ``cache_salt`` in an OpenAI-compatible request body.
    """

    def __init__(self, version: int = 0, prefix: str = "rollout-parity-weights-v") -> None:
        if int(version) < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self._version = int(version)
        self._prefix = prefix
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        return self._version

    @property
    def salt(self) -> str:
        return salt_for_version(self._version, self._prefix)

    def bump(self, to: int | None = None) -> int:
        """Advance to ``to`` (must not go back) or by one; returns the new version."""
        with self._lock:
            new = self._version + 1 if to is None else int(to)
            if new < self._version:
                raise ValueError(f"weight version cannot go back: {self._version} -> {new}")
            self._version = new
            return new

    def stamp(self, prompt: Any) -> dict[str, Any]:
        """A copy of ``prompt`` carrying this version's ``cache_salt``.

        ``prompt``: a string, a list of token IDs, or a vLLM prompt dict. An existing salt
        (e.g. per tenant) is kept and the version appended, so isolation is preserved.
        """
        if isinstance(prompt, str):
            out: dict[str, Any] = {"prompt": prompt}
        elif isinstance(prompt, dict):
            out = dict(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            out = {"prompt_token_ids": list(prompt)}
        else:
            raise TypeError(
                "prompt must be a str, a list of token IDs or a vLLM prompt dict, "
                f"got {type(prompt).__name__}"
            )
        old = out.get("cache_salt")
        out["cache_salt"] = self.salt if not old else f"{old}|{self.salt}"
        return out

    def stamp_all(self, prompts: Any) -> list[dict[str, Any]]:
        return [self.stamp(p) for p in prompts]

    def stamp_request_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """For ``vllm serve``'s OpenAI endpoints: a copy of the JSON body with ``cache_salt``."""
        out = dict(body)
        old = out.get("cache_salt")
        out["cache_salt"] = self.salt if not old else f"{old}|{self.salt}"
        return out


def _check_pause_api(engine: Any) -> None:
    for name in ("pause_generation", "resume_generation"):
        if not callable(getattr(engine, name, None)):
            raise TypeError(
                f"{type(engine).__name__} has no {name}(): pass a vLLM AsyncLLM (vLLM >= 0.11), "
                "or use update_weights_sync for an in-process vllm.LLM"
            )
    params = inspect.signature(engine.pause_generation).parameters
    if "mode" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise TypeError(
            "this vLLM's pause_generation() has no `mode` argument: the V0-like "
            "mode='keep' in-flight update needs a newer vLLM"
        )


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


async def update_weights_in_flight(
    engine: Any,
    load: Loader,
    *,
    prefix_cache_policy: str = "off",
    version: WeightVersion | None = None,
    load_args: tuple = (),
    load_kwargs: dict[str, Any] | None = None,
    pause_mode: str = "keep",
    clear_cache: bool = False,
) -> Any:
    """Pause an ``AsyncLLM``, load new weights, apply the prefix-cache policy, resume.

    ``load``: a callable run here (sync or async, called with ``load_args``/``load_kwargs``;
    it may itself await ``engine.collective_rpc(fn, args=...)`` to run ``fn`` on the
    workers), or the name of a worker method, called as
    ``engine.collective_rpc(load, args=load_args, kwargs=load_kwargs)``. Returns what ``load`` returned.
    ``version`` (required for ``salt``) is bumped after a successful load, so requests
    stamped afterwards carry the new salt. ``resume_generation`` always runs.
    """
    policy = normalize_prefix_cache_policy(prefix_cache_policy)
    if policy == "salt" and version is None:
        raise ValueError("prefix_cache_policy='salt' needs a WeightVersion (version=...) to stamp requests")
    _check_pause_api(engine)
    await engine.pause_generation(mode=pause_mode, clear_cache=clear_cache)
    try:
        if isinstance(load, str):
            result = await engine.collective_rpc(load, args=tuple(load_args), kwargs=load_kwargs)
        else:
            result = await _maybe_await(load(*load_args, **(load_kwargs or {})))
        if policy == "reset":
            ok = await engine.reset_prefix_cache(reset_running_requests=True)
            if ok is False:
                raise RuntimeError("vLLM refused to reset its prefix cache after the weight update")
        if version is not None:
            version.bump()
        return result
    finally:
        await engine.resume_generation()


def update_weights_sync(
    llm: Any,
    load: Loader,
    *,
    prefix_cache_policy: str = "off",
    version: WeightVersion | None = None,
    load_args: tuple = (),
    load_kwargs: dict[str, Any] | None = None,
) -> Any:
    """The synchronous equivalent for an in-process ``vllm.LLM``.

    ``LLM.generate`` blocks until its batch finishes, so between calls nothing is in flight
    and no pause is needed: load (a callable, or a worker method name for
    ``llm.collective_rpc``), then apply the prefix-cache policy and bump ``version``.
    """
    policy = normalize_prefix_cache_policy(prefix_cache_policy)
    if policy == "salt" and version is None:
        raise ValueError("prefix_cache_policy='salt' needs a WeightVersion (version=...) to stamp requests")
    if isinstance(load, str):
        result = llm.collective_rpc(load, args=tuple(load_args), kwargs=load_kwargs)
    else:
        result = load(*load_args, **(load_kwargs or {}))
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()  # never started: close it rather than leak an un-awaited coroutine
            raise TypeError("update_weights_sync got an async loader: use update_weights_in_flight")
    if policy == "reset":
        ok = llm.reset_prefix_cache(reset_running_requests=True)
        if ok is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after the weight update")
    if version is not None:
        version.bump()
    return result
