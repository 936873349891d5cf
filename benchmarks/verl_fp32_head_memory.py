"""What ``fp32_lm_head`` costs in verl's actor: peak memory of verl's own passes, fp32 head on and off.

    bash scripts/run.sh python benchmarks/verl_fp32_head_memory.py [--device cpu] [--vocab 32768 --tokens 2048]

verl's FSDP2 actor (``TrainingWorker``, built from verl's config as ``ActorRolloutRefWorker`` builds it, with
verl's mixed precision: bf16 ``param_dtype``, bf16 autocast) on one rank, a one-layer Qwen2 whose vocabulary
dominates memory, ``--tokens`` packed tokens (``use_remove_padding``, verl's default) at temperature 0.7. Two of
verl's passes are measured, each with the adapter's fp32 head and with the model's own bf16 head (the same
engine, ``revert_fp32_lm_head`` / ``apply_fp32_lm_head`` in between):

* ``pi_old``: ``infer_batch`` with entropy, verl's V1 pi_old pass (no gradient);
* ``update``: ``train_mini_batch``, verl's loss and backward on the same tokens.

Memory is the peak of bytes the pass allocates beyond what was live when it started: on CPU from the allocator's
own events (``rollout_parity.testing.memory.peak_alloc_bytes``), on CUDA ``max_memory_allocated``. It is printed
in units of one (N, V) bf16 logits tensor (N x V x 2 bytes), which is what the bf16 head itself returns.

Why the fp32 head costs what it costs here: verl's unfused path (``FSDPEngineWithLMHead.prepare_model_outputs``)
takes (N, V) logits from the lm_head module and derives everything from them (temperature scaling, entropy,
log-softmax, and their autograd state), so every one of those (N, V) tensors takes the logits' dtype; its fused
path never calls the lm_head module (and in verl 0.9.1 fails under FSDP2 with an untied head, whose weight it reads
while still sharded). The RESULT line gives the fp32/bf16 ratio of each pass's peak.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from integration_tests.support.processes import free_port

TEMPERATURE = 0.7


def _model(out: str, vocab: int, hidden: int) -> str:
    """A one-layer Qwen2 (fp32 on disk, untied head) with the tiny model's tokenizer files, in ``out``."""
    import shutil

    import torch
    import transformers

    from rollout_parity.testing.tiny_model import build_tiny_model

    tiny = build_tiny_model()
    for name in os.listdir(tiny):
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(os.path.join(tiny, name), out)
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(out)
    return out


def _peak(device: str, fn) -> int:
    import torch

    if device == "cpu":
        from rollout_parity.testing.memory import peak_alloc_bytes

        return peak_alloc_bytes(fn)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    if args.device == "cpu":
        from integration_tests.support.verl_cpu import ENV, install

        os.environ.update(ENV)
        install()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=0, world_size=1)

    from verl.utils import tensordict_utils as tu

    from integration_tests.support.verl_head_pass import DEFAULTS, _build
    from rollout_parity.core.fp32_head import apply_fp32_lm_head, is_fp32_lm_head, revert_fp32_lm_head

    n_seq = 4
    length = args.tokens // n_seq
    with tempfile.TemporaryDirectory() as out:
        opts = {**DEFAULTS, "fp32_head": True, "top_p": 1.0,
                "extra": [f"actor_rollout_ref.actor.ppo_mini_batch_size={n_seq}",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                          "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.use_kl_loss=false",
                          "actor_rollout_ref.actor.entropy_coeff=0"]}
        _, worker = _build(opts, _model(out, args.vocab, args.hidden))
    module = worker.engine.module
    assert is_fp32_lm_head(module)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, args.vocab, (length,), generator=g) for _ in range(n_seq)]
    prompt = length // 4
    nested = tu.nested_tensor_from_tensor_list

    def batch(update: bool):
        resp = [torch.ones(length - prompt, dtype=torch.long) for _ in seqs]
        data = {"input_ids": nested(seqs), "position_ids": nested([torch.arange(length)] * n_seq),
                "attention_mask": nested([torch.ones(length, dtype=torch.long)] * n_seq),
                "prompts": nested([s[:prompt] for s in seqs]), "responses": nested([s[prompt:] for s in seqs]),
                "loss_mask": nested(resp), "response_mask": nested(resp)}
        if not update:
            return tu.get_tensordict(data, non_tensor_dict={
                "temperature": TEMPERATURE, "compute_loss": False, "calculate_entropy": True,
                "global_token_num": None})
        lp = [torch.full((length - prompt,), -2.0) for _ in seqs]
        data.update(old_log_probs=nested(lp), rollout_log_probs=nested(lp),
                    advantages=nested([torch.ones(length - prompt)] * n_seq))
        return tu.get_tensordict(data, non_tensor_dict={
            "temperature": TEMPERATURE, "mini_batch_size": n_seq, "epochs": 1, "global_batch_size": n_seq,
            "seed": 1, "calculate_entropy": False, "dataloader_kwargs": {"shuffle": False}})

    passes = {"pi_old": lambda: worker.infer_batch(batch(False)), "update": lambda: worker.train_mini_batch(batch(True))}
    for fn in passes.values():  # warm-up: optimizer state, lazily built buffers
        fn()
    logits_bf16 = args.tokens * args.vocab * 2
    peaks = {}
    for head in ("bf16", "fp32"):
        (apply_fp32_lm_head if head == "fp32" else revert_fp32_lm_head)(module)
        for name, fn in passes.items():
            peaks[f"{name}_{head}"] = _peak(args.device, fn) / logits_bf16
    dist.destroy_process_group()
    return peaks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=2048, help="packed tokens of the micro-batch (4 sequences)")
    args = ap.parse_args(argv)
    peaks = run(args)
    print(f"verl FSDP2 actor, {args.tokens} tokens x vocab {args.vocab} (hidden {args.hidden}), device {args.device}; "
          "peak beyond the live memory, in units of one (N, V) bf16 logits tensor:")
    for name in ("pi_old", "update"):
        print(f"  {name:7s} bf16 head {peaks[name + '_bf16']:6.2f}   fp32 head {peaks[name + '_fp32']:6.2f}")
    print("RESULT " + " ".join(f"{name}_fp32_vs_bf16={peaks[name + '_fp32'] / peaks[name + '_bf16']:.3f}"
                               for name in ("pi_old", "update"))
          + " " + " ".join(f"{k}_logits={v:.2f}" for k, v in sorted(peaks.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
