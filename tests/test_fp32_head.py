"""apply_fp32_lm_head / revert_fp32_lm_head on tiny transformers models (built locally)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rollout_parity.testing.stack import need

from rollout_parity.core.fp32_head import (
    apply_fp32_lm_head,
    is_fp32_lm_head,
    revert_fp32_lm_head,
)

transformers = need("transformers", extra="test")


def tiny_model(arch="qwen2", tie=False, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits of a useful size, so bf16 rounding is visible
        model.get_output_embeddings().weight.normal_(0, 0.5)
    return model.to(dtype).eval()


IDS = torch.tensor([[1, 5, 9, 30, 2, 77, 4, 8], [3, 3, 60, 12, 90, 0, 7, 45]])


def last_hidden(model, ids=IDS):
    return model.model(input_ids=ids).last_hidden_state


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logits_are_the_fp32_projection(arch):
    model = tiny_model(arch)
    with torch.no_grad():
        before = model(input_ids=IDS).logits
        apply_fp32_lm_head(model)
        after = model(input_ids=IDS).logits
        h = last_hidden(model)
        W = model.lm_head.weight
        ref = F.linear(h.float(), W.float())
    assert before.dtype == torch.bfloat16 and after.dtype == torch.float32
    assert torch.equal(after, ref)
    assert (after - before.float()).abs().max() > 1e-3  # the bf16 head really differs
    assert model.lm_head.weight.dtype == torch.bfloat16  # parameters untouched


def test_autocast_is_disabled_inside_the_head():
    model = tiny_model(dtype=torch.float32)
    x = torch.randn(4, 32)
    apply_fp32_lm_head(model)
    with torch.no_grad():
        plain = model.lm_head(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model.lm_head(x)
        revert_fp32_lm_head(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto_unpatched = model.lm_head(x)
    assert auto.dtype == torch.float32 and torch.equal(auto, plain)
    assert auto_unpatched.dtype == torch.bfloat16  # what autocast would have done


def test_idempotent_and_revert_is_bit_exact():
    model = tiny_model()
    with torch.no_grad():
        original = model(input_ids=IDS).logits
    cls_forward = type(model.lm_head).forward
    apply_fp32_lm_head(model)
    patched_forward = model.lm_head.forward
    assert apply_fp32_lm_head(model) is model
    assert model.lm_head.forward == patched_forward and is_fp32_lm_head(model)
    revert_fp32_lm_head(model)
    assert not is_fp32_lm_head(model) and "forward" not in model.lm_head.__dict__
    assert type(model.lm_head).forward is cls_forward
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, original)
    revert_fp32_lm_head(model)  # reverting an unpatched model is a no-op
    assert sorted(model.state_dict()) == sorted(tiny_model().state_dict())


def test_tied_embeddings_keep_working():
    model = tiny_model(tie=True)
    emb = model.get_input_embeddings()
    assert model.lm_head.weight is emb.weight
    apply_fp32_lm_head(model)
    assert model.lm_head.weight is emb.weight  # still one shared Parameter
    assert emb(IDS).dtype == torch.bfloat16  # input side keeps the model dtype
    out = model(input_ids=IDS, labels=IDS)
    assert out.logits.dtype == torch.float32
    out.loss.backward()
    g_patched = emb.weight.grad.clone()
    assert g_patched.dtype == torch.bfloat16 and g_patched.abs().sum() > 0
    # The shared weight's gradient has both contributions: compare with an explicit fp32 head.
    model.zero_grad()
    revert_fp32_lm_head(model)
    h = last_hidden(model)
    logits = F.linear(h.float(), emb.weight.float())
    ref_loss = F.cross_entropy(logits[:, :-1].reshape(-1, 96), IDS[:, 1:].reshape(-1))
    ref_loss.backward()
    torch.testing.assert_close(out.loss.detach(), ref_loss.detach())
    assert torch.equal(g_patched, emb.weight.grad)


def test_nn_linear_directly_and_float64_stays_float64():
    lin = nn.Linear(8, 5).double()
    apply_fp32_lm_head(lin)
    x = torch.randn(3, 8, dtype=torch.float64)
    assert lin(x).dtype == torch.float64
    revert_fp32_lm_head(lin)
    lin16 = nn.Linear(8, 5).to(torch.bfloat16)
    apply_fp32_lm_head(lin16)
    x = torch.randn(3, 8).to(torch.bfloat16)
    out = lin16(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, F.linear(x.float(), lin16.weight.float(), lin16.bias.float()))


def test_refuses_peft_wrapped_head():
    peft = need("peft", extra="dev")
    for kwargs in (dict(target_modules=["lm_head"]), dict(target_modules=["q_proj"], modules_to_save=["lm_head"])):
        model = peft.get_peft_model(tiny_model(dtype=torch.float32), peft.LoraConfig(r=2, **kwargs))
        with pytest.raises(TypeError, match="PEFT"):
            apply_fp32_lm_head(model)
    # LoRA elsewhere leaves a plain head: allowed.
    model = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    apply_fp32_lm_head(model)
    assert model.get_output_embeddings().forward.__func__.__name__ == "_fp32_linear_forward"


def test_peft_detected_by_class_without_importing_peft():
    code = (
        "import sys, torch\n"
        "from torch import nn\n"
        "import rollout_parity.core.fp32_head as m\n"
        "assert 'peft' not in sys.modules\n"
        "LoraLayer = type('LoraLayer', (), {})\n"
        "Fake = type('Linear', (nn.Linear, LoraLayer), {'__module__': 'peft.tuners.lora.layer'})\n"
        "try:\n"
        "    m.apply_fp32_lm_head(Fake(4, 4))\n"
        "except TypeError as e:\n"
        "    assert 'PEFT' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('not refused')\n"
        "assert 'peft' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_refuses_other_heads_and_foreign_patches():
    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="stock forward"):
        apply_fp32_lm_head(Custom(4, 4))
    with pytest.raises(TypeError, match="no get_output_embeddings"):
        apply_fp32_lm_head(nn.Sequential(nn.Linear(4, 4)))
    lin = nn.Linear(4, 4)
    lin.forward = lambda x: x
    with pytest.raises(RuntimeError, match="already replaced"):
        apply_fp32_lm_head(lin)


def test_accelerate_hook_is_kept():
    accelerate_hooks = need("accelerate.hooks", extra="trl")
    calls = []

    class Count(accelerate_hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(1)
            return args, kwargs

    model = tiny_model()
    accelerate_hooks.add_hook_to_module(model.lm_head, Count())
    with torch.no_grad():
        original = model(input_ids=IDS).logits
        apply_fp32_lm_head(model)
        patched = model(input_ids=IDS).logits
        revert_fp32_lm_head(model)
        reverted = model(input_ids=IDS).logits
    assert patched.dtype == torch.float32 and len(calls) == 3
    assert torch.equal(reverted, original)
