#!/usr/bin/env bash
# Build (once) the venv that runs a live SGLang engine on this CPU for the SGLang tests
# (integration_tests/test_sglang_engine.py, test_sglang_server_args.py), and print its python.
#
#   bash scripts/sglang_venv.sh            # builds on first use (~2 min, ~2.8 GB), then reuses
#   SGLANG_VENV=/path bash scripts/...      # another location
#
# SGLang's wheel pins a CUDA torch and CUDA-only kernels, so it cannot share the project's venv. Here:
# python3.11 -m venv; torch 2.13.0 CPU; sglang 0.5.23 --no-deps; torchvision 0.16.2 --no-deps; the runtime
# dependencies listed below (sglang's own metadata minus CUDA-only packages, restricted to what a CPU engine
# imports), pinned by scripts/sglang_constraints.txt; and the one stand-in, sgl_kernel's few ops in plain
# PyTorch (integration_tests/support/sglang_cpu/: it replaces kernel ops only and validates no argument away).
# Idempotent: rebuilt only when this file, the constraints or the stand-in change (a stamp records them).
# A venv at that path that this script did not make is left alone (the script stops).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
standin="$here/../integration_tests/support/sglang_cpu"
venv="${SGLANG_VENV:-$HOME/.cache/rollout-parity/sglang-0.5.23}"
py="$venv/bin/python"
marker="$venv/.rollout-parity-sglang-venv"
stamp="$venv/.rollout-parity-sglang-stamp"
constraints="$here/sglang_constraints.txt"   # the whole resolved closure, pinned (from a verified freeze)
nice_="nice -n 15"

# sglang 0.5.23's Requires-Dist (METADATA), non-CUDA and imported by a CPU Engine, pinned. Where sglang pins
# (==) the pin is sglang's; the others are the versions resolved and tested here.
DEPS=(
  aiohttp==3.14.5 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 distro==1.9.0 einops==0.8.2
  fastapi==0.165.0 gguf==0.19.0 ipython==9.18.1 mistral_common==1.13.1 msgspec==0.23.0 numpy==2.3.5
  nvidia-ml-py==13.615.71 openai==2.8.0 orjson==3.13.0 packaging==26.4 partial-json-parser==0.2.1.1.post7
  pillow==13.0.0 psutil==7.2.2 pybase64==1.5.1 pydantic==2.14.4 python-multipart==0.0.34 pyzmq==27.3.0
  regex==2026.11.19 requests==2.34.2 scipy==1.17.1 sentencepiece==0.2.1 setproctitle==1.3.8
  smg-grpc-servicer==0.14.1 soundfile==0.13.1 tiktoken==0.14.0 tokenizers==0.23.2 tqdm==4.70.1
  transformers==5.19.0 uvicorn==0.54.0 uvloop==0.23.0 watchfiles==1.3.0 xgrammar==0.2.7 zstandard==0.25.0
  # not in sglang's metadata (its CUDA torch brings it): sglang imports triton at module level
  # (e.g. sglang/kernels/ops/kvcache/cache_move.py:2); xgrammar requires it on Linux x86_64 too.
  triton==3.9.0
  # not in sglang's metadata either: sglang/srt/sampling/custom_logit_processor.py:7 imports dill at module
  # level, on the config-resolution path (datasets brings it in a full sglang install).
  dill==0.4.1
  # rollout-parity's own dependencies (pyproject.toml; torch and pyyaml are there already): the tests run the
  # checkout under test from this venv (PYTHONPATH), as a user who installed rollout-parity[sglang] would.
  omegaconf==2.3.0
)
# Left out of sglang's metadata on purpose:
#   CUDA-only: cuda-python flash-attn-4 flashinfer_python[cu13] humming-kernels[cu13] nvidia-cutlass-dsl[cu13]
#     nvidia-mathdx nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla sglang-kernel
#     tilelang torch_memory_saver torchaudio torchcodec; torch==2.14.1 (a CUDA build here) -> torch 2.13.0 CPU.
#   torchvision (unpinned there): 0.16.2 --no-deps, see below. timm==1.0.25 (needs torchvision; not imported).
#   Not imported by a CPU Engine (text model, no grammar/tools/multimodal): anthropic blobfile build datasets
#     easydict interegular kernels llguidance modelscope ninja numba openai-harmony outlines prometheus-client
#     py-spy python-dateutil xxhash deepseek-recipe tml-renderers (x86 Linux markers) av decord2 (aarch64 only).

want="$({ cat "${BASH_SOURCE[0]}" "$standin"/pyproject.toml "$standin"/sgl_kernel/*.py
          cat "$constraints" 2>/dev/null || true; } | sha256sum | cut -d' ' -f1)"
if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "$py"
  exit 0
fi
if [ -e "$venv" ] && [ ! -e "$marker" ]; then
  echo "[sglang_venv.sh] $venv exists and was not made by this script: move it away or set SGLANG_VENV" >&2
  exit 1
fi
rm -rf "$venv"
$nice_ python3.11 -m venv "$venv"
touch "$marker"
pip_() { $nice_ "$py" -m pip install -q "$@"; }
pip_ --upgrade pip
cons=(); [ -f "$constraints" ] && cons=(-c "$constraints")
# torch first, alone: the CPU wheel (pip's find-links here hold torch-2.13.0+cpu). A torch requested
# unpinned by another package would pull a multi-GB CUDA build instead.
pip_ "${cons[@]}" torch==2.13.0
"$py" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else
  f"torch {torch.__version__} is a CUDA build: install the 2.13.0 CPU wheel (PyTorch CPU wheel index)")'
# sglang's wheel pins torch==2.14.1 and the CUDA stack: its own code only, dependencies below.
pip_ --no-deps sglang==0.5.23
# SGLang imports torchvision.transforms while resolving any model config (sglang/srt/configs/__init__.py:71
# -> configs/nano_nemotron_vl.py:22 -> multimodal/internvl_utils.py:5). PyPI's torchvision wheels are CUDA
# builds; 0.17+ register fake kernels for torchvision::nms unconditionally and fail to import when their _C
# cannot load ("operator torchvision::nms does not exist"). 0.16.2 guards every registration behind
# extension._has_ops(), so its pure-Python transforms import on CPU torch 2.13 (ops and io are unavailable).
pip_ --no-deps torchvision==0.16.2
pip_ "${cons[@]}" -c <(echo torch==2.13.0) "${DEPS[@]}"
build="$(mktemp -d)"; cp -r "$standin" "$build/standin"   # a copy: the build leaves nothing in the checkout
pip_ --no-deps --no-build-isolation "$build/standin"; rm -rf "$build"
SGLANG_USE_CPU_ENGINE=1 "$py" - <<'EOF'
import torch, torchvision.transforms, sgl_kernel, sglang, transformers, triton
from sglang.srt.server_args import ServerArgs  # noqa: F401
assert torch.version.cuda is None, torch.__version__
assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed"), "stand-in must not enable the AMX paths"
print(f"[sglang_venv.sh] torch {torch.__version__}, sglang {sglang.__version__}, transformers {transformers.__version__},"
      f" sgl_kernel stand-in {sgl_kernel.__version__}")
EOF
echo "$want" > "$stamp"
echo "[sglang_venv.sh] built $venv" >&2
echo "$py"
