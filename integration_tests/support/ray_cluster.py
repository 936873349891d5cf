"""Test support: a Ray cluster of two nodes on 127.0.0.1, ``ray job submit`` against it, and a sure stop.

What a verl user does when one machine is not enough, on one machine: ``ray start --head`` (with
the dashboard's job server), ``ray start --address=<head>`` for a second node with resources of its
own, then ``ray job submit -- python -m verl.trainer.main_ppo ...``. Every node, driver and worker
is pinned to 127.0.0.1:

* every Ray process gets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, without which Ray replaces a
  loopback address (``--node-ip-address=127.0.0.1``, ``--address=127.0.0.1:port``, a driver's
  ``RAY_ADDRESS``) by the machine's routable one (``services.resolve_ip_for_localhost``);
* with that switch Ray's CLI refuses to start a worker node ("Multi-node Ray clusters are not
  supported on Windows and OSX"), so the second node's ``ray start`` runs through
  ``ray_loopback_node.py``: Ray's own CLI with that one refusal lifted and loopback kept;
* the dashboard binds to 127.0.0.1 (``--dashboard-host``), the Ray client server to a free port;
* token authentication stays on, with a token made for this cluster (``RAY_AUTH_TOKEN``), never
  the machine's shared ``~/.ray/auth_token``.

Each ``ray start --block`` runs in a session of its own; :meth:`LoopbackCluster.stop` kills both
sessions (every raylet, GCS, dashboard, worker and job driver they started) and nothing else,
never ``ray stop``, which would end every Ray on this shared machine.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional, Sequence

from .processes import free_port
from .verl_main_ppo import end_session, session_members

__all__ = ["LoopbackCluster", "JobRun", "loopback_ray_tmp", "remove"]

#: Ray's CLI through this interpreter: a checkout's own environment (scripts/run.sh) has no ``ray`` script beside it.
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


@dataclasses.dataclass
class JobRun:
    """What one ``ray job submit`` left: its status, the job's whole log and the submit command's output."""

    submission_id: str
    status: str
    logs: str
    submit_output: str
    seconds: float


@dataclasses.dataclass
class LoopbackCluster:
    root: Path
    env: dict  # every process of the cluster (and the ray CLI calls) runs with this environment
    head_resources: dict
    worker_resources: dict
    gcs_port: int = dataclasses.field(default_factory=free_port)
    dashboard_port: int = dataclasses.field(default_factory=free_port)
    procs: list = dataclasses.field(default_factory=list)

    @classmethod
    def create(cls, root: Path, machine_env: dict, head_resources: dict, worker_resources: dict) -> "LoopbackCluster":
        env = dict(machine_env)
        env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex,
                   RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        return cls(root=root, env=env, head_resources=head_resources, worker_resources=worker_resources)

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, name: str, command: Sequence[str]) -> None:
        log = open(self.root / f"{name}.log", "w")
        proc = subprocess.Popen(list(command), cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append((name, proc, log))

    @staticmethod
    def _resources(spec: dict) -> list[str]:
        return [f"--num-cpus={spec.get('CPU', 0)}", f"--num-gpus={spec.get('GPU', 0)}"]

    def start(self, timeout: float = 240.0) -> list[dict]:
        """Both nodes, waited for until the GCS lists two ALIVE nodes; returns them."""
        self.root.mkdir(parents=True, exist_ok=True)
        common = ["--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
        self._start("head", [*RAY, "start", "--head", *common, f"--port={self.gcs_port}",
                             "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                             f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={free_port()}",
                             f"--temp-dir={self.env['RAY_TMPDIR']}", *self._resources(self.head_resources)])
        deadline = time.monotonic() + timeout
        while not self._alive(1):
            self._check_running(deadline)
        self._start("worker", [sys.executable, "-m", "integration_tests.support.ray_loopback_node", "start", *common,
                               f"--address=127.0.0.1:{self.gcs_port}", *self._resources(self.worker_resources)])
        while not self._alive(2):
            self._check_running(deadline)
        return self.nodes()

    def _check_running(self, deadline: float) -> None:
        for name, proc, _ in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start ({name}) exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError("the two Ray nodes did not come up in time:\n"
                               + "\n".join(self.log(name)[-2000:] for name, _, _ in self.procs))
        time.sleep(3)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def ray(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """The ``ray`` CLI, talking to this cluster's dashboard."""
        return subprocess.run([*RAY, *args], cwd=self.root, env={**self.env, "RAY_ADDRESS": self.dashboard},
                              capture_output=True, text=True, timeout=timeout)

    def nodes(self) -> list[dict]:
        proc = self.ray("list", "nodes", "--format", "json", "--detail")
        if proc.returncode != 0:
            return []
        try:
            return json.loads(proc.stdout)
        except ValueError:
            return []

    def _alive(self, n: int) -> bool:
        if not self.procs or self.procs[-1][1].poll() is not None:
            return False
        try:
            return sum(node.get("state") == "ALIVE" for node in self.nodes()) >= n
        except subprocess.TimeoutExpired:
            return False

    def submit(self, entrypoint: Sequence[str], env_vars: dict, submission_id: str, timeout: float = 1200.0) -> JobRun:
        """``ray job submit --runtime-env-json '{"env_vars": ...}' -- <entrypoint>``, waited for; status and logs."""
        start = time.monotonic()
        command = ["job", "submit", f"--submission-id={submission_id}",
                   f"--runtime-env-json={json.dumps({'env_vars': env_vars})}", "--", *entrypoint]
        try:
            submitted = self.ray(*command, timeout=timeout)
            output = submitted.stdout + submitted.stderr
        except subprocess.TimeoutExpired as exc:
            output = f"{exc.stdout or ''}{exc.stderr or ''}\n[ray_cluster] job killed after {timeout} s\n"
            self.ray("job", "stop", submission_id)
        status = self.ray("job", "status", submission_id)
        logs = self.ray("job", "logs", submission_id, timeout=300)
        said = _plain(status.stdout + status.stderr + output)
        state = next((w for w in ("SUCCEEDED", "FAILED", "STOPPED", "RUNNING", "PENDING") if w in said), None)
        if state is None:  # the submit command's own last word: "Job '<id>' succeeded" / "failed"
            state = "SUCCEEDED" if f"Job '{submission_id}' succeeded" in said else \
                "FAILED" if f"Job '{submission_id}' failed" in said else "UNKNOWN"
        return JobRun(submission_id=submission_id, status=state, logs=_plain(logs.stdout + logs.stderr),
                      submit_output=said, seconds=time.monotonic() - start)

    def pids(self) -> list[int]:
        """Every process of the cluster: the members of both ``ray start`` sessions."""
        return [pid for _, proc, _ in self.procs for pid in session_members(proc.pid)]

    def sockets(self) -> dict[str, list[str]]:
        """The cluster's listening addresses and the remote ends of its connections (``ip:port``)."""
        import psutil

        mine = set(self.pids())
        listening, remote = [], []
        for conn in psutil.net_connections(kind="inet"):
            if conn.pid not in mine:
                continue
            if conn.status == psutil.CONN_LISTEN:
                listening.append(f"{conn.laddr.ip}:{conn.laddr.port}")
            elif conn.raddr:
                remote.append(f"{conn.raddr.ip}:{conn.raddr.port}")
        return {"listening": listening, "remote": remote}

    def stop(self, timeout: float = 60.0) -> list[int]:
        """Kill both sessions (whatever Ray started in them) until none of their processes is alive; returns the ids.

        Killing repeats while members remain: a raylet may start a worker between the listing and the kill.
        """
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            alive = self.left()
            if not alive or time.monotonic() > deadline:
                break
            for _, proc, _ in self.procs:
                killed += [pid for pid in end_session(proc.pid) if pid not in killed]
            time.sleep(0.5)
        for _, proc, log in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait for anyone
                pass
            log.close()
        return killed

    def left(self) -> list[int]:
        """Processes of the cluster's sessions still alive (a killed process not yet reaped is not)."""
        return [pid for _, proc, _ in self.procs for pid in session_members(proc.pid) if not _zombie(pid)]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True  # gone


def _plain(text: str) -> str:
    """Without the terminal colour codes Ray puts around its log prefixes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def loopback_ray_tmp() -> str:
    """A short directory for Ray's session sockets (an AF_UNIX path must fit 107 bytes)."""
    return tempfile.mkdtemp(prefix="rp-ray-")


def remove(path: Optional[str]) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)

