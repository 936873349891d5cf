"""The loss reaches NeMo RL's policy workers: pickled on the driver, unpickled where a worker runs.

NeMo RL's ``Policy.train`` sends ``loss_fn`` to Ray actors (``lm_policy.py``); Ray serialises it
with its ``cloudpickle``, which pickles ``RolloutParityLossFn`` *by reference* to
``rollout_parity.adapters.nemo_rl.handover``. A worker runs in NeMo RL's own ``uv`` environment
(``PY_EXECUTABLES.AUTOMODEL``, ``MCORE``, ...; ``distributed/virtual_cluster.py``), which holds
torch and NeMo RL but not rollout-parity unless the user adds it (docs/nemo_rl_workers.md).

Each check runs in a fresh ``python -S`` process whose ``sys.path`` holds only the venv's
site-packages (torch, pydantic, ...; no ``.pth`` file, so no editable install of ours) and NeMo RL's
source (the anchor, loaded by file path): what breaks without our package, and that with it on the
path (``PYTHONPATH``, which NeMo RL forwards to every worker, or the package installed in the
worker's venv) the loss unpickles and gives the driver's numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from integration_tests.support.nemo_anchor import ANCHORS, VERSIONS, anchor_root, skip_unless_available
from integration_tests.support.nemo_harness import load, nemo_data

pytestmark = [pytest.mark.nemo_rl]

ROOT = Path(__file__).resolve().parents[1]
# The importer of NeMo RL's source trees needs only the standard library: loaded by path, it works in a
# worker without rollout-parity.
SOURCE_MODULE = ROOT / "rollout_parity" / "check" / "nemo_source.py"

WORKER = '''
import importlib.util, json, pickle, sys
sys.path[:0] = json.loads(sys.argv[1])  # the worker's environment, nothing else
spec = importlib.util.spec_from_file_location("nemo_source", sys.argv[2])
source = importlib.util.module_from_spec(spec)
spec.loader.exec_module(source)
with source.SOURCES.activate(sys.argv[3]):
    import torch
    blob, batch = open(sys.argv[4], "rb").read(), torch.load(sys.argv[5])
    try:
        loss_fn = pickle.loads(blob)
    except ModuleNotFoundError as exc:
        print(json.dumps({"error": str(exc)}))
        sys.exit(0)
    arrived_empty = loss_fn.last_correction is None
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    data = BatchedDataDict(batch["data"])
    cur = batch["cur"].requires_grad_(True)
    loss, metrics = loss_fn(next_token_logprobs=cur, data=data, global_valid_seqs=batch["gvs"],
                            global_valid_toks=batch["gvt"])
    loss.backward()
    print(json.dumps({"type": type(loss_fn).__module__ + "." + type(loss_fn).__qualname__,
                      "loss": float(loss), "grad": cur.grad.tolist(), "metrics": metrics,
                      "arrived_empty": arrived_empty,
                      "rollout_parity_from": sys.modules["rollout_parity"].__file__}))
'''


def run_worker(tmp_path: Path, version: str, paths: list[str]) -> dict:
    result = subprocess.run(
        [sys.executable, "-S", "-c", WORKER, json.dumps(paths), str(SOURCE_MODULE), str(anchor_root() / version),
         str(tmp_path / "loss.pkl"), str(tmp_path / "batch.pt")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version", VERSIONS)
def test_the_pickled_loss_in_a_workers_environment(tmp_path, version):
    skip_unless_available([version])
    import ray.cloudpickle as cloudpickle  # what Ray serialises actor-method arguments with

    from rollout_parity.adapters.nemo_rl import RolloutParityLossFn

    with ANCHORS.activate(version) as ns:
        load(ns)
        loss_fn = RolloutParityLossFn.from_nemo_config({
            "reference_policy_kl_penalty": 0.01, "rollout_parity": "rollout-parity",
            "rollout_correction": {"rollout_importance_sampling_mode": "token_truncate",
                                   "rollout_rejection": ["seq_sum_k3"], "rollout_rejection_threshold": 0.01}})
        g = torch.Generator().manual_seed(7)
        old = -torch.rand(4, 6, generator=g) - 0.1
        gen, cur = old + 0.2 * torch.randn(4, 6, generator=g), old + 0.05 * torch.randn(4, 6, generator=g)
        data = nemo_data(ns, old, gen, cur.clone().requires_grad_(True), torch.ones(4, 6),
                         torch.tensor([1.0, -1.0, 0.5, -0.5]))
        gvs, gvt = torch.tensor(4.0), torch.tensor(24.0)
        leaf = cur.clone().requires_grad_(True)
        loss, metrics = loss_fn(next_token_logprobs=leaf, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
        loss.backward()
        (tmp_path / "loss.pkl").write_bytes(cloudpickle.dumps(loss_fn))
        batch = {k: v for k, v in data.items() if k != "next_token_logprobs"}
        torch.save({"data": batch, "cur": cur, "gvs": gvs, "gvt": gvt}, tmp_path / "batch.pt")
    # This interpreter's site directories, and those its .pth files add (a checkout's own environment reaches the
    # shared stack through one): the worker gets them as plain paths, so no .pth of theirs runs there.
    site = list(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                               *(p for p in sys.path if p.endswith("site-packages"))]))
    # NeMo RL's worker venv as NeMo RL builds it: no rollout-parity.
    broken = run_worker(tmp_path, version, site)
    assert broken == {"error": "No module named 'rollout_parity'"}
    # With the package importable (PYTHONPATH, forwarded by NeMo RL to every worker, or installed there).
    worker = run_worker(tmp_path, version, site + [str(ROOT)])
    assert worker["type"] == "rollout_parity.adapters.nemo_rl.handover.RolloutParityLossFn"
    assert worker["rollout_parity_from"].startswith(str(ROOT))
    assert worker["loss"] == float(loss)
    assert torch.equal(torch.tensor(worker["grad"]), leaf.grad)
    assert worker["metrics"] == metrics
    # The driver's last batch stays on the driver: the worker gets the flags and NeMo RL's loss.
    assert loss_fn.last_correction is not None and worker["arrived_empty"]
