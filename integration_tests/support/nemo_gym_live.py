"""The pieces of the live NeMo Gym multi-turn test: a tiny model that sometimes stops on EOS, a
vLLM OpenAI server with the parity recipe, NeMo Gym's ``vllm_model`` server in front of it, and
re-scoring a prompt with vLLM's prompt logprobs. Servers bind to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

from .processes import free_port, stop
from rollout_parity.engines.vllm.features import cpu_threads_bind

REPO = Path(__file__).resolve().parents[2]
GYM_SERVER = Path(__file__).with_name("nemo_gym_server.py")
SERVED_NAME = "tiny-policy"
# Final-layer recipe of the EOS-prone model (see build_eos_model).
_EOS_DIM, _EOS_FEATURE, _EOS_GAIN = 0, 3.0, 1.3


def build_eos_model(path: Path) -> str:
    """The project's tiny fp32 Qwen2 with one change: EOS is likely enough (a few % to ~50%
    per step, depending on the context) that some turns end on EOS and some on max_tokens.

    Every token embedding gets a constant feature in one hidden dimension, which survives the
    final RMSNorm; only EOS's lm_head row reads that dimension. fp32, so that vLLM's decode
    and its prompt re-scoring agree to rounding.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_parity.testing.tiny_model import EOS_TOKEN, build_tiny_model

    stamp = path / "rollout_parity_eos_model.json"
    recipe = {"dim": _EOS_DIM, "feature": _EOS_FEATURE, "gain": _EOS_GAIN, "v": 1}
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return str(path)
    base = build_tiny_model(dtype="float32", seed=3)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(base)
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, _EOS_DIM] = _EOS_FEATURE
        head = model.get_output_embeddings().weight
        head[:, _EOS_DIM] = 0.0
        head[eos, _EOS_DIM] = _EOS_GAIN
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    stamp.write_text(json.dumps(recipe))
    return str(path)


def http_json(url: str, body: Optional[dict] = None, timeout: float = 120.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: HTTP {exc.code}: {exc.read().decode()[:2000]}") from exc


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(1.0)
    raise RuntimeError(f"server at {url} not up after {timeout:.0f}s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def _process(cmd: list[str], env: dict, log: Path, ready_url: str, timeout: float) -> Iterator[None]:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait(ready_url, proc, log, timeout)
        yield
    finally:
        stop(proc)


@contextlib.contextmanager
def vllm_server(model: str, log_dir: Path) -> Iterator[str]:
    """``python -m vllm.entrypoints.openai.api_server`` with the parity recipe's flags
    (``vllm_serve_flags()``: processed logprobs, no prefix caching, no async scheduling),
    fp32, the model's own generation config ignored (plain temperature-1 sampling); yields
    the base URL (``.../v1``)."""
    from rollout_parity.engines.vllm.recipe import vllm_serve_flags

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "1024", "--seed", "0",
           "--generation-config", "vllm", "--max-num-seqs", "4", *vllm_serve_flags()]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
               VLLM_CPU_OMP_THREADS_BIND=cpu_threads_bind(), HF_HUB_OFFLINE="1")
    with _process(cmd, env, log_dir / "vllm.log", f"http://127.0.0.1:{port}/health", 300):
        yield f"http://127.0.0.1:{port}/v1"


@contextlib.contextmanager
def nemo_gym_server(gym_python: str, vllm_url: str, log_dir: Path) -> Iterator[str]:
    """NeMo Gym's ``vllm_model`` app (support/nemo_gym_server.py) in the 3.12 venv; yields
    its base URL."""
    port = free_port()
    cmd = [gym_python, str(GYM_SERVER), "--vllm-url", vllm_url, "--model", SERVED_NAME,
           "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    with _process(cmd, env, log_dir / "nemo_gym.log", f"http://127.0.0.1:{port}/", 120):
        yield f"http://127.0.0.1:{port}"


def prompt_logprobs(vllm_url: str, token_ids: list[int]) -> list[Optional[float]]:
    """vLLM's logprob of every token of ``token_ids`` given the tokens before it (None for
    the first), from the completions endpoint's ``prompt_logprobs``."""
    out = http_json(f"{vllm_url}/completions", {
        "model": SERVED_NAME, "prompt": token_ids, "max_tokens": 1, "temperature": 1.0,
        "prompt_logprobs": 0})
    entries = out["choices"][0]["prompt_logprobs"]
    values: list[Optional[float]] = []
    for tid, entry in zip(token_ids, entries):
        values.append(None if entry is None else entry[str(tid)]["logprob"])
    return values
