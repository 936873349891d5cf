"""What the correction costs on top of the loss: B=64, T=4096, fp32, CPU.

Prints, measured in this one run (machines here are noisy, so only ratios are compared):
  policy_loss alone (forward + backward)                      -> the baseline
  compute_correction (tis_srs_k3 + off-policy mask + all metrics) + policy_loss (fwd+bwd)
and their ratio. Target: ratio <= 1.5, i.e. the correction costs at most half the loss.

The loss is timed with its backward because that is what a training step pays for it; the
correction has no backward (its weights are detached). Both include their metrics' host sync.

Last line: ``RESULT overhead_ratio=...`` (every benchmark's last line, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import time

import torch

from rollout_parity import CorrectionConfig, compute_correction, policy_loss


def make_batch(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3
    rollout = old + torch.randn(B, T, generator=g) * 0.02
    current = (old + torch.randn(B, T, generator=g) * 0.05).requires_grad_()
    adv = torch.randn(B, generator=g)
    return old, rollout, current, mask, adv


def fastest(fns: dict, repeats: int) -> dict:
    """The fastest call of each function, calling them in turn so drift in machine load hits all alike.

    On a shared machine noise only ever adds time, so the minimum is the stable statistic.
    """
    for fn in fns.values():
        fn()  # warm-up
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()

    old, rollout, current, mask, adv = make_batch(args.batch, args.tokens)
    plain = CorrectionConfig()
    cfg = CorrectionConfig.preset("tis_srs_k3", off_policy_sequence_mask_delta=0.5)

    def loss_only():
        current.grad = None
        loss, _ = policy_loss(plain, current_logprobs=current, old_logprobs=old, advantages=adv, response_mask=mask)
        loss.backward()

    def corrected():
        current.grad = None
        out = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                                 advantages=adv, current_logprobs=current)
        loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=adv, correction=out)
        loss.backward()

    def correction_only():
        compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask,
                           advantages=adv, current_logprobs=current)

    best = fastest({"loss": loss_only, "full": corrected, "correction": correction_only}, args.repeats)
    t_base, t_full, t_corr = best["loss"], best["full"], best["correction"]
    ratio = t_full / t_base

    print(f"B={args.batch} T={args.tokens} fp32 CPU, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'what':58s} {'ms':>9s}")
    print(f"{'policy_loss alone (fwd+bwd)':58s} {t_base * 1e3:9.2f}")
    print(f"{'compute_correction (tis_srs_k3 + off-policy + metrics)':58s} {t_corr * 1e3:9.2f}")
    print(f"{'compute_correction + policy_loss (fwd+bwd)':58s} {t_full * 1e3:9.2f}")
    print(f"overhead ratio (target <= 1.5): {ratio:.3f}")
    print(f"RESULT overhead_ratio={ratio:.3f} correction_vs_loss={t_corr / t_base:.3f}")


if __name__ == "__main__":
    main()
