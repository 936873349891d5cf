"""The TRL 1.15 CPU head stand-in (test support) against TRL 1.16's own CPU path.

``scripts/compat.sh trl 1.15.0`` runs the adapter tests through ``trl_cpu_head`` because TRL
1.15's fused head is Triton-only. The stand-in is worth what it agrees with: TRL 1.16's
``ChunkedLogProbFunction`` (torch ops where there is no Triton), on values and gradients, with
softcapping, a logit scale, a bias, bf16 autocast and every optional output.
"""

import pytest
import torch

from rollout_parity.testing.stack import need

pytestmark = pytest.mark.trl


@pytest.mark.parametrize("case", ["plain", "softcap_scale_bias", "bf16_autocast"])
def test_stand_in_equals_trl_own_cpu_path(case):
    need("trl")
    from trl.kernels.chunked_logprob import OPTIONAL_OUTPUTS, ChunkedLogProbFunction, _use_triton

    from integration_tests.support.trl_cpu_head import fused_head_logprobs

    assert not _use_triton(torch.device("cpu"))  # TRL's torch path is the reference here
    g = torch.Generator().manual_seed(3)
    n, h, v = 37, 16, 301
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.5
    bias = torch.randn(v, generator=g) if case == "softcap_scale_bias" else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[0] = (hidden[0] @ weight.T).argmax()  # at least one argmax target for is_top1
    softcap, scale = (7.0, 1.3) if case == "softcap_scale_bias" else (None, 1.0)

    def run(fn):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16_autocast"):
            out = fn(x, w, bias, targets, 0.7, softcap, scale, OPTIONAL_OUTPUTS)
        (out[0].sum() + 0.3 * out[1].sum()).backward()
        return out, x.grad, w.grad

    ours = run(fused_head_logprobs)
    trl = run(lambda x, w, b, t, temp, cap, sc, outs: ChunkedLogProbFunction.apply(x, w, b, t, temp, 64, cap, sc, outs))
    tol = dict(atol=2e-2, rtol=2e-2) if case == "bf16_autocast" else dict(atol=1e-5, rtol=1e-5)
    for name, a, b in zip(["logprob", "entropy", "log_sum_sq_probs", "mean_logits"], ours[0], trl[0]):
        torch.testing.assert_close(a, b, **tol, msg=name)
    assert torch.equal(ours[0][4], trl[0][4]) and ours[0][4].any()
    torch.testing.assert_close(ours[1], trl[1], **tol, msg="grad hidden")
    torch.testing.assert_close(ours[2], trl[2], **tol, msg="grad weight")


def test_installed_only_where_trl_has_no_cpu_path(monkeypatch):
    need("trl")
    import trl.trainer.utils as trl_utils

    from integration_tests.support import trl_cpu_head

    before = trl_utils._ChunkedLogProbFunction
    monkeypatch.setattr(trl_cpu_head, "version", lambda _: "1.16.0")
    assert trl_cpu_head.install() is False and trl_utils._ChunkedLogProbFunction is before
    monkeypatch.setattr(trl_cpu_head, "version", lambda _: "1.15.0")
    assert trl_cpu_head.install() and trl_cpu_head.install()  # idempotent
    assert trl_utils._ChunkedLogProbFunction is trl_cpu_head._TorchChunkedLogProb
    trl_cpu_head.revert()
    assert trl_utils._ChunkedLogProbFunction is before
