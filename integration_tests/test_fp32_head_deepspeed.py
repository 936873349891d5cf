"""apply_fp32_lm_head under DeepSpeed ZeRO-3 on CPU (DS_ACCELERATOR=cpu, gloo, one process).

The lm_head weight is partitioned (its local tensor is empty); ZeRO's pre-forward hook gathers
it when the module is called.  The patch replaces only the instance forward, so the hook still
fires: the patched logits must equal an fp32 projection computed on an unpartitioned copy of
the same weights, the weight must be partitioned again afterwards, gradients must flow, and
revert must give back the unpatched ZeRO-3 logits bit for bit.
"""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.nn.functional as F

from rollout_parity.testing.stack import need

deepspeed = need("deepspeed", extra="deepspeed")
transformers = need("transformers", extra="test")

from rollout_parity.core.fp32_head import apply_fp32_lm_head, revert_fp32_lm_head  # noqa: E402

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

IDS = torch.tensor([[1, 5, 9, 30, 2, 77, 4, 8], [3, 3, 60, 12, 90, 0, 7, 45]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dist():
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        pytest.skip("this test runs DeepSpeed on CPU (DS_ACCELERATOR=cpu)")
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="1",
               RANK="0", LOCAL_RANK="0")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ours = not torch.distributed.is_initialized()
    if ours:
        deepspeed.init_distributed(dist_backend="gloo")
    yield
    if ours and torch.distributed.is_initialized():  # leave no group behind for other modules
        torch.distributed.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _tiny(arch: str, tie: bool):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.5)
    return model.to(torch.bfloat16)


@pytest.mark.parametrize("arch, tie", [("qwen2", False), ("llama", True)])
def test_fp32_head_under_zero3(dist, arch, tie):
    model = _tiny(arch, tie)
    ref = copy.deepcopy(model).eval()  # unpartitioned copy of the same weights
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    head = engine.module.get_output_embeddings()
    assert head.weight.numel() == 0 and tuple(head.weight.ds_shape) == (96, 32)  # partitioned

    with torch.no_grad():
        unpatched = engine(input_ids=IDS).logits
        h = ref.model(input_ids=IDS).last_hidden_state
        ref_bf16 = ref(input_ids=IDS).logits
        ref_fp32 = F.linear(h.float(), ref.get_output_embeddings().weight.float())
    assert unpatched.dtype == torch.bfloat16 and torch.equal(unpatched, ref_bf16)

    apply_fp32_lm_head(engine.module)
    apply_fp32_lm_head(engine.module)  # idempotent under ZeRO-3 too
    out = engine(input_ids=IDS, labels=IDS)
    assert out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits.detach(), ref_fp32, rtol=0, atol=1e-6)
    assert (out.logits.detach() - unpatched.float()).abs().max() > 1e-3
    assert head.weight.numel() == 0  # released again after the forward

    engine.backward(out.loss)
    grad = deepspeed.utils.safe_get_full_grad(head.weight)
    assert grad is not None and tuple(grad.shape) == (96, 32)
    ref_logits = F.linear(h.float(), ref.get_output_embeddings().weight.float())
    ref_loss = F.cross_entropy(ref_logits[:, :-1].reshape(-1, 96), IDS[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss.detach().float(), ref_loss.detach(), rtol=0, atol=1e-5)
    if not tie:  # the tied weight also collects the embedding's gradient
        ref_loss.backward()
        gref = ref.get_output_embeddings().weight.grad.float()
        torch.testing.assert_close(grad.float(), gref, rtol=2e-2, atol=2e-3)
    engine.zero_grad()

    revert_fp32_lm_head(engine.module)
    with torch.no_grad():
        assert torch.equal(engine(input_ids=IDS).logits, unpatched)
