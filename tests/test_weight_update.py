"""The weight-update helper's protocol on stand-in engines (the real engine: integration_tests)."""

from __future__ import annotations

import asyncio

import pytest

from rollout_parity.engines.vllm.weight_update import (WeightVersion, salt_for_version, update_weights_in_flight,
                                               update_weights_sync)


class FakeAsyncEngine:
    def __init__(self):
        self.calls = []

    async def pause_generation(self, *, mode="abort", wait_for_inflight_requests=None, clear_cache=True):
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self):
        self.calls.append(("resume",))

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset", reset_running_requests))
        return True

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method, args, kwargs))
        return ["ok"]


@pytest.mark.parametrize("policy,expect_reset", [("off", False), ("reset", True), ("salt", False)])
def test_in_flight_update_order(policy, expect_reset):
    eng, version = FakeAsyncEngine(), WeightVersion()

    async def load(x):
        eng.calls.append(("load", x))
        return 7

    result = asyncio.run(update_weights_in_flight(eng, load, load_args=(3,), prefix_cache_policy=policy,
                                                  version=version))
    assert result == 7 and version.value == 1
    expected = [("pause", "keep", False), ("load", 3)] + ([("reset", True)] if expect_reset else []) + [("resume",)]
    assert eng.calls == expected


def test_collective_rpc_loader_and_resume_on_failure():
    eng = FakeAsyncEngine()
    assert asyncio.run(update_weights_in_flight(eng, "receive_weight_update", load_args=("{}",))) == ["ok"]
    assert eng.calls[1] == ("rpc", "receive_weight_update", ("{}",), None)

    eng, version = FakeAsyncEngine(), WeightVersion(4)

    def boom():
        raise RuntimeError("nccl died")

    with pytest.raises(RuntimeError, match="nccl died"):
        asyncio.run(update_weights_in_flight(eng, boom, prefix_cache_policy="salt", version=version))
    assert eng.calls[-1] == ("resume",) and version.value == 4  # resumed, version not bumped


def test_salt_needs_a_version_and_old_pause_api_is_refused():
    with pytest.raises(ValueError, match="WeightVersion"):
        asyncio.run(update_weights_in_flight(FakeAsyncEngine(), lambda: None, prefix_cache_policy="salt"))

    class Old(FakeAsyncEngine):
        async def pause_generation(self, *, wait_for_inflight_requests=False, clear_cache=True):
            pass

    with pytest.raises(TypeError, match="mode"):
        asyncio.run(update_weights_in_flight(Old(), lambda: None))
    with pytest.raises(TypeError, match="pause_generation"):
        asyncio.run(update_weights_in_flight(object(), lambda: None))


def test_sync_update_resets_and_bumps():
    calls = []

    class LLM:
        def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
            calls.append(("reset", reset_running_requests))
            return True

    v = WeightVersion()
    update_weights_sync(LLM(), lambda: calls.append("load"), prefix_cache_policy="reset", version=v)
    assert calls == ["load", ("reset", True)] and v.value == 1

    class Refusing(LLM):
        def reset_prefix_cache(self, *a, **k):
            return False

    with pytest.raises(RuntimeError, match="refused"):
        update_weights_sync(Refusing(), lambda: None, prefix_cache_policy="reset")


def test_sync_update_by_worker_method_name():
    """``update_weights_sync(llm, "reload_weights", load_kwargs=...)``: vLLM's own reload on every worker."""
    calls = []

    class LLM:
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            calls.append((method, args, kwargs))
            return [None]

        def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
            calls.append(("reset", reset_running_requests))
            return True

    v = WeightVersion()
    weights = [("lm_head.weight", object())]
    update_weights_sync(LLM(), "reload_weights", load_kwargs={"weights_iterator": weights},
                        prefix_cache_policy="salt", version=v)
    assert calls == [("reload_weights", (), {"weights_iterator": weights})] and v.value == 1
    with pytest.raises(TypeError, match="async loader"):
        async def coro():
            return None
        update_weights_sync(LLM(), coro)


def test_weight_version_stamps():
    v = WeightVersion()
    assert v.stamp("hi") == {"prompt": "hi", "cache_salt": "rollout-parity-weights-v0"}
    assert v.stamp([1, 2]) == {"prompt_token_ids": [1, 2], "cache_salt": "rollout-parity-weights-v0"}
    v.bump()
    assert v.stamp({"prompt": "x", "cache_salt": "tenant"})["cache_salt"] == "tenant|rollout-parity-weights-v1"
    assert v.stamp_request_body({"model": "m"})["cache_salt"] == v.salt
    with pytest.raises(ValueError, match="back"):
        v.bump(to=0)
    with pytest.raises(TypeError, match="prompt"):
        v.stamp(3.5)


def test_in_flight_update_can_clear_the_cache_while_paused():
    """``clear_cache=True`` reaches vLLM's ``pause_generation`` (the recipe's default keeps the cache)."""
    eng = FakeAsyncEngine()
    asyncio.run(update_weights_in_flight(eng, lambda: None, clear_cache=True, pause_mode="wait"))
    assert eng.calls[0] == ("pause", "wait", True)


def test_a_salt_prefix_separates_tenants_sharing_one_engine():
    a, b = WeightVersion(3, prefix="tenant-a/v"), WeightVersion(3, prefix="tenant-b/v")
    assert a.salt == "tenant-a/v3" == salt_for_version(3, prefix="tenant-a/v") and b.salt == "tenant-b/v3"
    assert a.stamp([1, 2])["cache_salt"] != b.stamp([1, 2])["cache_salt"]
    assert salt_for_version(3) == WeightVersion(3).salt == "rollout-parity-weights-v3"
