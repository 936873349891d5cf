"""What the correction costs on top of the loss: B=64, T=4096, fp32, on ``--device`` (cpu or cuda).

Prints, measured in this one run (machines here are noisy, so only ratios are compared):
  policy_loss alone (forward + backward)                      -> the baseline
  compute_correction (tis_srs_k3 + off-policy mask + all metrics) + policy_loss (fwd+bwd)
and their ratio, with the correction as it runs by default (eager) and with ``compile_correction``
(``torch.compile``: its passes fused). The compiled correction is timed as a run reaches it after its first
steps: a batch 64 tokens shorter compiles first, so the timed batch runs the graph with the length symbolic
(what TRL's changing completion lengths give), and compiling is not timed. Beside it, the correction's graph
with the batch size and the length both symbolic (a run where both change), against the eager correction.
Target: ratio <= 1.5, i.e. the correction costs at most half the loss.

The loss is timed with its backward because that is what a training step pays for it; the
correction has no backward (its weights are detached). Both include their metrics' one host
sync each; on a GPU every timed call ends with ``torch.cuda.synchronize()``, so a call's time is
its kernels' time, not only their launch.

Last line: ``RESULT overhead_ratio=... correction_vs_loss=... metrics_vs_loss=... compiled_overhead_ratio=...
compiled_vs_eager=... both_symbolic_vs_eager=...`` (ratios of this run; ``--no-compile`` leaves out the compiled ones).
"""

from __future__ import annotations

import argparse
import time

import torch

from rollout_parity import CorrectionConfig, compute_correction, policy_loss
from rollout_parity.core.correction import correction_token_pass


def make_batch(B: int, T: int, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3
    rollout = old + torch.randn(B, T, generator=g) * 0.02
    current = old + torch.randn(B, T, generator=g) * 0.05
    adv = torch.randn(B, generator=g)
    old, rollout, mask, adv = (t.to(device) for t in (old, rollout, mask, adv))
    return old, rollout, current.to(device).requires_grad_(), mask, adv


def tis_srs_k3_with_off_policy_mask() -> CorrectionConfig:
    """The ``tis_srs_k3`` preset plus the off-policy mask at 0.5, written out: the preset loader needs
    omegaconf, which a bare GPU image may lack (tests/test_benchmark_flags.py checks it equals the preset)."""
    return CorrectionConfig(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=2.0,
                            rollout_rejection=["seq_sum_k3"], rollout_rejection_threshold=0.001,
                            off_policy_sequence_mask_delta=0.5)


def fastest(fns: dict, repeats: int, device: str = "cpu") -> dict:
    """The fastest call of each function, calling them in turn so drift in machine load hits all alike.

    On a shared machine noise only ever adds time, so the minimum is the stable statistic.
    """
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for fn in fns.values():
        fn()  # warm-up
    sync()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--no-compile", action="store_true", help="time the eager correction only")
    args = parser.parse_args()

    old, rollout, current, mask, adv = make_batch(args.batch, args.tokens, device=args.device)
    plain = CorrectionConfig()
    cfg = tis_srs_k3_with_off_policy_mask()

    def loss_only():
        current.grad = None
        loss, _ = policy_loss(plain, current_logprobs=current, old_logprobs=old, advantages=adv, response_mask=mask)
        loss.backward()

    def corrected_with(flags: CorrectionConfig):
        def run():
            current.grad = None
            out = compute_correction(flags, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                                     advantages=adv, current_logprobs=current)
            loss, _ = policy_loss(flags, current_logprobs=current, old_logprobs=old, advantages=adv, correction=out)
            loss.backward()
        return run

    def correction_only(with_metrics: bool, flags: CorrectionConfig = cfg):
        def run():
            compute_correction(flags, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                               advantages=adv, current_logprobs=current, with_metrics=with_metrics)
        return run

    compiled = cfg.replace(compile_correction=True)
    timed = {"loss": loss_only, "full": corrected_with(cfg), "correction": correction_only(True),
             "no_metrics": correction_only(False)}
    if not args.no_compile:
        short = make_batch(args.batch, args.tokens - 64, seed=1, device=args.device)
        compute_correction(compiled, old_logprobs=short[0], rollout_logprobs=short[1], response_mask=short[3],
                           advantages=short[4], current_logprobs=short[2])
        timed.update(full_compiled=corrected_with(compiled), correction_compiled=correction_only(True, compiled))
        # What a run whose batch size and length both change gets: both dimensions symbolic.
        both_symbolic = torch.compile(correction_token_pass, dynamic=True)
        inputs = (old, rollout, mask, adv, current.detach())
        timed["correction_both_symbolic"] = lambda: both_symbolic(cfg, *inputs, True)[-1].tolist()
    best = fastest(timed, args.repeats, args.device)
    t_base, t_full, t_corr, t_bare = best["loss"], best["full"], best["correction"], best["no_metrics"]
    ratio = t_full / t_base

    where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"B={args.batch} T={args.tokens} fp32 on {where}, torch {torch.__version__}")
    print(f"{'what':58s} {'ms':>9s}")
    print(f"{'policy_loss alone (fwd+bwd)':58s} {t_base * 1e3:9.3f}")
    print(f"{'compute_correction (tis_srs_k3 + off-policy), no metrics':58s} {t_bare * 1e3:9.3f}")
    print(f"{'compute_correction (tis_srs_k3 + off-policy + metrics)':58s} {t_corr * 1e3:9.3f}")
    print(f"{'compute_correction + policy_loss (fwd+bwd)':58s} {t_full * 1e3:9.3f}")
    compiled_result = ""
    if not args.no_compile:
        t_ccorr, t_cfull = best["correction_compiled"], best["full_compiled"]
        print(f"{'compute_correction, compile_correction=true (+ metrics)':58s} {t_ccorr * 1e3:9.3f}")
        print(f"{'the same + policy_loss (fwd+bwd)':58s} {t_cfull * 1e3:9.3f}")
        t_both = best["correction_both_symbolic"]
        print(f"{'compiled correction, batch and length both symbolic':58s} {t_both * 1e3:9.3f}")
        compiled_result = (f" compiled_overhead_ratio={t_cfull / t_base:.3f} compiled_vs_eager={t_ccorr / t_corr:.3f}"
                           f" both_symbolic_vs_eager={t_both / t_corr:.3f}")
    print(f"overhead ratio (target <= 1.5): {ratio:.3f}")
    print(f"RESULT overhead_ratio={ratio:.3f} correction_vs_loss={t_corr / t_base:.3f} "
          f"metrics_vs_loss={(t_corr - t_bare) / t_base:.3f}{compiled_result}")


if __name__ == "__main__":
    main()
