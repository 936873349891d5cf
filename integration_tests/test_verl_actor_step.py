"""One actor update through verl's own per-micro-batch loss path, on CPU (issues 5, 10, 11).

verl's FSDP engine calls ``verl.workers.utils.losses.ppo_loss(config, model_output, data)`` for
every micro-batch; that function selects the batch fields, converts verl's nested layout to
padded tensors, fetches the configured loss (verl's ``vanilla``, through our wrapper) and adds
entropy/KL terms. In-process, a tiny local Qwen2 produces the packed token logprobs exactly as
the engine lays them out, ``ppo_loss`` turns them into a loss, one SGD step moves the
parameters; an independent copy updated with the core's ``compute_correction`` +
``policy_loss`` on padded tensors lands on the same parameters, and our metrics, aggregated by
verl's own ``Metric`` rules, are the core's.

In subprocesses: verl's own FSDP actor (``TrainingWorker`` -> ``FSDPEngineWithLMHead``, FSDP2 on
one gloo rank) with a **bf16 model** (verl's default mixed precision: bf16 forward) and
``fp32_lm_head``, on the CPU platform of integration_tests/support/verl_cpu; and verl's
per-micro-batch metric path on 2 gloo ranks against 1 rank (integration_tests/support/
verl_dp_metrics.py).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout_parity.testing.stack import need

need("verl", extra="verl")
transformers = need("transformers", extra="test")

from hydra import compose, initialize_config_dir  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from integration_tests.support.spread import bound  # noqa: E402
from rollout_parity import CorrectionConfig, compute_correction, policy_loss  # noqa: E402
from rollout_parity.adapters import verl as adapter  # noqa: E402
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.verl]

LR = 0.5
PROMPT_LENS = [3, 5, 2, 4]
RESPONSE_LENS = [6, 2, 7, 4]


@functools.lru_cache(maxsize=None)
def actor_config(loss_agg_mode):
    config_dir = os.path.join(os.path.dirname(core_algos.__file__), "..", "config")
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode}",
            "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.use_kl_loss=false"])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def packed_logprobs(model, sequences):
    """Per-token log p(next token), packed over sequences as verl's engine returns them."""
    out = []
    for ids in sequences:
        logits = model(input_ids=ids.unsqueeze(0)).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        nxt = torch.roll(ids, -1)  # the engine rolls input_ids by -1
        out.append(lp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1))
    return torch.cat(out)


def padded_response_logprobs(model, sequences, T):
    rows = []
    for ids, p, r in zip(sequences, PROMPT_LENS, RESPONSE_LENS):
        logits = model(input_ids=ids.unsqueeze(0)).logits[0].float()
        lp = torch.log_softmax(logits[p - 1:p + r - 1], dim=-1).gather(-1, ids[p:p + r].unsqueeze(-1)).squeeze(-1)
        rows.append(torch.nn.functional.pad(lp, (0, T - r)))
    return torch.stack(rows)


def nested(rows):
    return tu.nested_tensor_from_tensor_list(list(rows))


@pytest.fixture(scope="module")
def tiny():
    return transformers.AutoModelForCausalLM.from_pretrained(build_tiny_model(), torch_dtype=torch.float32)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("preset", ["tis_srs_k3", "verl_decoupled_token_is"])
def test_one_update_through_verls_ppo_loss_moves_params_as_the_core_predicts(tiny, preset, loss_agg_mode):
    torch.manual_seed(0)
    cfg = CorrectionConfig.preset(preset)
    if cfg.rollout_rejection is not None:  # a threshold that rejects some sequences of this batch
        cfg = cfg.replace(rollout_rejection_threshold=0.02)
    vocab = tiny.config.vocab_size
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, vocab, (p + r,), generator=g) for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    B, T = len(sequences), max(RESPONSE_LENS)
    mask = (torch.arange(T)[None] < torch.tensor(RESPONSE_LENS)[:, None]).float()

    model_verl, model_core = copy.deepcopy(tiny), copy.deepcopy(tiny)
    with torch.no_grad():
        old = padded_response_logprobs(tiny, sequences, T)  # pi_old: the policy before the update
    rollout = old + torch.randn(B, T, generator=g) * 0.1  # the engine's mismatched logprobs
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.2])

    # driver: our correction, as the driver hook writes it into the batch
    out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    assert out.mask.sum() < mask.sum() or cfg.rollout_rejection is None
    lens = RESPONSE_LENS
    adv_tok = advantages[:, None] * mask

    # verl: the micro-batch in verl's nested layout, the loss through verl's ppo_loss
    adapter.set_active_config(cfg)
    try:
        data = tu.get_tensordict({
            "prompts": nested(s[:p] for s, p in zip(sequences, PROMPT_LENS)),
            "responses": nested(s[p:] for s, p in zip(sequences, PROMPT_LENS)),
            "response_mask": nested(out.mask[i, :lens[i]] for i in range(B)),
            "old_log_probs": nested(old[i, :lens[i]] for i in range(B)),
            "rollout_log_probs": nested(rollout[i, :lens[i]] for i in range(B)),  # present, never passed on
            "advantages": nested(adv_tok[i, :lens[i]] for i in range(B)),
            "rollout_is_weights": nested(out.weights[i, :lens[i]] for i in range(B)),
        })
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum().item()), global_batch_size=B)
        config = actor_config(loss_agg_mode)
        loss_verl, metrics = ppo_loss(config, {"log_probs": packed_logprobs(model_verl, sequences)}, data)
    finally:
        adapter.set_active_config(None)
    loss_verl.backward()
    with torch.no_grad():
        for p in model_verl.parameters():
            p -= LR * p.grad

    # core: padded tensors, verl's token count as the normaliser (the rollout's loss_mask)
    current = padded_response_logprobs(model_core, sequences, T)
    loss_core, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=advantages,
                               correction=out, clip_ratio=0.2, clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode,
                               global_num_tokens=float(mask.sum()), global_num_seqs=float(B))
    loss_core.backward()
    with torch.no_grad():
        for p in model_core.parameters():
            p -= LR * p.grad

    torch.testing.assert_close(loss_verl.detach(), loss_core.detach(), atol=1e-6, rtol=1e-6)
    moved = 0.0
    for (name, pv), pc, p0 in zip(model_verl.named_parameters(), model_core.parameters(), tiny.parameters()):
        torch.testing.assert_close(pv, pc, atol=1e-6, rtol=1e-5, msg=name)
        moved = max(moved, (pv - p0).abs().max().item())
    assert moved > 1e-4, "the update did not move the parameters"
    # verl ran its own vanilla loss (its actor/* metrics, verl Metrics) on our mask: here, one micro-batch, the
    # core's own numbers; our wrapper repeats none of them
    from verl.utils.metric import Metric

    _, core_metrics = policy_loss(cfg, current_logprobs=current.detach(), old_logprobs=old,
                                  advantages=advantages, correction=out, clip_ratio=0.2, clip_ratio_c=3.0)
    assert not [k for k in metrics if k.endswith("ppo_k1_mean") or k.startswith("policy/")]
    for key, logged in (("policy/ppo_k1_mean", "actor/ppo_kl"), ("policy/pg_clipfrac", "actor/pg_clipfrac"),
                        ("policy/pg_clipfrac_lower", "actor/pg_clipfrac_lower")):
        assert isinstance(metrics[logged], Metric)
        assert metrics[logged].aggregate() == pytest.approx(core_metrics[key], abs=1e-6), logged


def _support(module, *args, timeout=600):
    repo = Path(__file__).resolve().parents[1]
    # As a verl 0.8 command line must (no verl.plugins entry points there): verl imports the
    # adapter at ``import verl`` in every process, before any module binds verl's names.
    modules = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    env = dict(os.environ, MASTER_PORT=str(29500 + (os.getpid() % 400)),
               VERL_USE_EXTERNAL_MODULES=",".join(dict.fromkeys([*modules, adapter.MODULE])))
    proc = subprocess.run([sys.executable, "-m", f"integration_tests.support.{module}", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT_JSON ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT_JSON "))


def test_one_update_of_verls_own_fsdp_actor_with_a_bf16_model_and_the_fp32_head():
    """TrainingWorker -> FSDP2 (bf16 forward) -> ppo_loss -> verl's vanilla loss via our wrapper -> SGD."""
    result = _support("verl_actor_step_cpu", "tis_srs_k3")
    assert result["engine"] == "FSDPEngineWithLMHead"
    # a bf16 model: verl's autocast and the body's hidden states are bf16
    assert result["autocast_dtype"] == "torch.bfloat16" and result["hidden_dtype"] == "torch.bfloat16"
    # the head computes in fp32 (our hook on verl's model build), and only then
    assert result["fp32_head_applied_at_build"]
    assert result["head_output_dtype_fp32_head"] == "torch.float32"
    assert result["head_output_dtype_bf16_head"] == "torch.bfloat16"
    # verl's own log-prob pass changes with it, towards the fp64 head over the same hidden states. The values beside
    # the bounds: batch seeds 3 + (0-4) (spread.seed(), read by the support process),
    # integration_tests/data/spread/test_verl_actor_step.json, from ``wt-run python scripts/measure_spread.py
    # integration_tests/test_verl_actor_step.py -k fsdp_actor --seeds 0 1 2 3 4``. fp32 vs bf16: 0.011-0.017, 11x
    # over; the fp32 head's max error against fp64 7.3e-7-8.5e-7 (12x under), the bf16 head's 0.028-0.043 (28x over).
    assert bound("fp32 vs bf16 head: mean |d|", result["fp32_vs_bf16_head_mean_abs"], ">", 1e-3)
    assert bound("fp32 head: max |logprob - fp64|", result["fp32_head_err_vs_fp64"], "<", 1e-5)
    assert bound("bf16 head: max |logprob - fp64| / 100", result["bf16_head_err_vs_fp64"] / 100, ">", 1e-5)
    # the update: verl's FSDP step vs the core on an independent copy (bf16 autocast, fp32 head): loss within
    # 0.1 %-2.3 % (2.2x under), 1 - cosine within ±1.3e-5 (580x under), norms within 0.004 %-0.6 % (3.2x under)
    assert bound("|verl loss / core loss - 1|", abs(result["verl_loss"] / result["core_loss"] - 1), "<=", 0.05)
    assert bound("1 - cosine of verl's and the core's updates", 1 - result["update_cosine"], "<", 1e-3)
    assert bound("|update norm ratio - 1|", abs(result["update_norm_ratio"] - 1), "<", 0.02)
    assert result["moved"] > 1e-3 and result["rejected_tokens"] > 0 and result["kept_tokens"] > 0
    assert {"actor/ppo_kl", "rollout_correction/loss_nonfinite_frac", "rollout_correction/loss_contrib_pos"} <= set(
        result["metric_keys"])


@pytest.mark.parametrize("name, mode", [("tis_srs_k3", "vanilla"), ("off_policy_mask", "gspo")])
def test_two_gloo_ranks_give_one_ranks_loss_gradient_and_metrics(name, mode):
    """verl's per-micro-batch metric path (postprocess, allgather, aggregate_dp) on the shared batch."""
    result = _support("verl_dp_metrics", name, mode)
    assert result["our_keys"], "the adapter added no metrics"
    assert result["loss_ranks"] == pytest.approx(result["loss_single"], abs=1e-6)
    assert result["grad_max"] > 0 and result["grad_max_diff"] < 1e-7
    assert result["metric_max_diff"] < 1e-6, (result["metrics_single"], result["metrics_ranks"])
    assert not result["repeats_verls_ppo_kl"]  # vanilla and gspo log their own actor/ppo_kl
