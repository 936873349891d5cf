"""``compile_correction``: the correction through ``torch.compile`` gives the eager correction's tensors and metrics.

The compiled pass is torch's Inductor (C++ on CPU) running ``correction_token_pass`` as one graph; the reference
is the same function run eagerly, which the rest of the suite checks against a naive re-implementation. The
batch holds every bad-input case (NaN, ±inf on each side, an empty sequence, a NaN advantage) so that a fused
kernel that simplified ``x − x`` or reordered a ``nan_to_num`` would show here.
"""

from __future__ import annotations

import math

import torch
from torch._dynamo.utils import counters

from rollout_parity import CorrectionConfig, compute_correction

#: Fused kernels sum in another order than eager torch. Measured over five shapes (the three below, 64x512 and
#: 16x2048; 2026-11-27, this machine): tensors differ by at most 1.2e-7 (one fp32 ulp of a weight near 1, 8x
#: under TENSOR_ATOL); a metric's difference used at most 6.6% of its bound (|d| <= 1e-4 |value| + 1e-6: 15x).
#: Exact bits would fail on a CPU whose vector width orders the sums differently.
TENSOR_ATOL = 1e-6
METRIC_RTOL, METRIC_ATOL = 1e-4, 1e-6

FLAGS = CorrectionConfig.preset("tis_srs_k3", off_policy_sequence_mask_delta=0.05)


def bad_input_batch(batch: int, tokens: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, tokens, generator=g) * 3
    rollout = old + torch.randn(batch, tokens, generator=g) * 0.3
    # Odd rows drift from the sampler by 0.2 on average: the off-policy mask takes those with A < 0.
    current = old + torch.randn(batch, tokens, generator=g) * 0.1 - 0.2 * (torch.arange(batch) % 2)[:, None]
    mask = (torch.rand(batch, tokens, generator=g) > 0.2).float()
    mask[1] = 0  # an empty sequence
    for values, (row, col), bad in ((old, (0, 0), math.nan), (rollout, (0, 1), math.inf), (current, (0, 2), -math.inf),
                                    (old, (0, 3), -math.inf), (rollout, (0, 3), -math.inf),
                                    (rollout, (2, 5), -math.inf), (old, (2, 6), math.inf)):
        values[row, col] = bad
        mask[row, col] = 1.0
    advantages = torch.randn(batch, generator=g)
    advantages[3] = -1.0
    advantages[1] = math.nan  # GRPO's advantage of an empty sequence
    return dict(old_logprobs=old, rollout_logprobs=rollout, current_logprobs=current, response_mask=mask,
                advantages=advantages)


def test_compiled_correction_equals_the_eager_one_and_compiles_once_for_every_later_shape():
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for shape, seed in (((8, 64), 0), ((5, 97), 1), ((6, 40), 2)):
        batch = bad_input_batch(*shape, seed)
        eager = compute_correction(FLAGS, **batch)
        assert counters["stats"]["unique_graphs"] == sum(graphs[-1:]), "the default path must not compile"
        compiled = compute_correction(FLAGS.replace(compile_correction=True), **batch)
        graphs.append(counters["stats"]["unique_graphs"])
        for name in ("weights", "mask", "log_ratio", "sequence_log_ratio", "rejected", "off_policy_masked",
                     "nonfinite"):
            want, got = getattr(eager, name), getattr(compiled, name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            torch.testing.assert_close(got, want, rtol=0, atol=TENSOR_ATOL, msg=name)
        assert compiled.nonfinite.sum() == 6 and compiled.rejected.sum() > 0 and compiled.off_policy_masked.any()
        assert compiled.metrics.keys() == eager.metrics.keys()
        for key, want in eager.metrics.items():
            assert abs(compiled.metrics[key] - want) <= METRIC_RTOL * abs(want) + METRIC_ATOL, key
    # One graph for the first shape, one with symbolic sizes once the shape changed; none after that.
    assert graphs[0] >= 1 and graphs[2] == graphs[1]
