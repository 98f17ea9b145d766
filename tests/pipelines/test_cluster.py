"""rlflow on a Ray cluster started with `ray start`: two nodes on this machine, and job submission.

Each node is a `ray start --block` in its own process group, with its own temp dir; the finalizer
ends those groups (never `ray stop`, which would stop every Ray cluster of this user). The test
clusters are bound to 127.0.0.1 and run with RAY_AUTH_MODE=disabled, except the job-submission
one, which runs with token authentication as Ray 2.60's `ray start` does by default: every node,
driver and `ray job` call then needs the token, as docs/howto/cluster.md tells users.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Ray nodes on this machine, each `--num-cpus=cpus`, the first one the head."""

    def __init__(self, nodes: int, cpus: int, dashboard: bool = False, env: dict | None = None) -> None:
        self.env = env or ENV
        self.port, self.dashboard = free_port(), free_port()
        self.temp = tempfile.mkdtemp(prefix="rlc", dir="/tmp")  # short: Ray's socket paths must fit
        self.procs: list[subprocess.Popen] = []
        head = ["--head", "--node-ip-address=127.0.0.1", f"--port={self.port}", f"--temp-dir={self.temp}",
                f"--include-dashboard={str(dashboard).lower()}", "--disable-usage-stats"]
        if dashboard:
            head += ["--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard}",
                     f"--dashboard-agent-listen-port={free_port()}"]
        self.start(head, cpus, "node_0")
        for i in range(1, nodes):
            self.start([f"--address=127.0.0.1:{self.port}", "--node-ip-address=127.0.0.1"], cpus, f"node_{i}")
        self.wait_for(nodes)

    def start(self, args: list[str], cpus: int, resource: str) -> None:
        cmd = [str(BIN / "ray"), "start", "--block", f"--num-cpus={cpus}", "--num-gpus=0",
               f"--resources={json.dumps({resource: 1})}", *args]
        log = open(Path(self.temp) / f"{resource}.log", "w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def wait_for(self, nodes: int, timeout_s: float = 60.0) -> None:
        probe = (f"import ray; ray.init(address='127.0.0.1:{self.port}', logging_level='ERROR'); "
                 "print(sum(n['Alive'] for n in ray.nodes()))")
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            assert all(p.poll() is None for p in self.procs), self.logs()
            out = subprocess.run([sys.executable, "-c", probe], env=self.env, capture_output=True, text=True,
                                 timeout=60)
            if out.stdout.strip() == str(nodes):
                return
            time.sleep(1)
        raise TimeoutError(f"{nodes} Ray nodes not up in {timeout_s}s\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in Path(self.temp).glob("*.log"))

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            for p in reversed(self.procs):
                if p.poll() is None:
                    os.killpg(p.pid, sig)
            deadline = time.time() + wait_s
            while any(p.poll() is None for p in self.procs) and time.time() < deadline:
                time.sleep(0.2)
        # Ray's own daemons (gcs, raylet, dashboard, workers) run in those groups too; end stragglers
        # that still name this cluster's temp dir.
        import psutil

        for proc in psutil.process_iter(["cmdline"]):
            if any(self.temp in a for a in proc.info["cmdline"] or ()):
                proc.kill()
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture
def cluster(request):
    made: list[Cluster] = []

    def make(nodes: int, cpus: int, dashboard: bool = False, env: dict | None = None) -> Cluster:
        made.append(Cluster(nodes, cpus, dashboard, env))
        return made[-1]

    yield make
    for c in made:
        c.stop()


class Probe:
    """A stage that reports where its rank runs and sums a tensor over the pool."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def where(self) -> tuple[int, str]:
        import ray

        return self.rank, ray.get_runtime_context().get_node_id()

    def all_reduce(self) -> float:
        import torch

        t = torch.tensor([float(self.rank + 1)])
        torch.distributed.all_reduce(t)
        return float(t.item())


def test_pool_spreads_ranks_over_nodes_in_node_order(cluster, monkeypatch):
    import ray
    from ray import cloudpickle

    from rlflow.pipelines.runtime import build, start_pool

    c = cluster(nodes=2, cpus=2)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    ray.init(address=f"127.0.0.1:{c.port}", logging_level="ERROR")
    try:
        driver_node = ray.get_runtime_context().get_node_id()
        pool = start_pool("probe", 4, gpus=0.0, threads=1, group=True, timeout_s=60)
        assert len(pool.groups) == 2  # one STRICT_PACK group per node
        probes = build(Probe, pool, lambda r: {"rank": r})
        where = probes.all(Probe.where)
        assert [r for r, _ in where] == [0, 1, 2, 3]
        nodes = [n for _, n in where]
        assert nodes[0] == nodes[1] == driver_node != nodes[2] == nodes[3]
        # the process group spans both nodes: 1 + 2 + 3 + 4 on every rank
        assert probes.all(Probe.all_reduce) == [10.0] * 4
        pool.shutdown()
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def only_run(db: Path):
    client = MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def assert_three_steps(db: Path) -> None:
    client, run = only_run(db)
    assert run.info.status == "FINISHED"
    for key in ("actor/pg_loss", "critic/score/mean"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2, 3], key


def test_train_runs_one_hybrid_worker_per_node(cluster, tmp_path):
    # one CPU per node: the two ranks of the hybrid pool can only sit one on each node
    c = cluster(nodes=2, cpus=1)
    env = {**ENV, "RAY_ADDRESS": f"127.0.0.1:{c.port}", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    proc = subprocess.run([str(BIN / "rlflow"), "train", str(ROOT / "conf" / "smoke.yaml"), "placement.workers=2",
                           f"trainer.output_dir={tmp_path / 'out'}", "trainer.val_every=0"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_three_steps(tmp_path / "mlflow.db")


def test_ray_job_submit_runs_a_recipe_from_a_users_project_with_a_token(cluster, tmp_path):
    """The user's project is the job's working directory, first on every process's sys.path, and
    holds folders named engine, stages and pipelines, which must not shadow rlflow's (each fails
    loudly if imported); the recipe is named, not a path into the repo. The cluster authenticates
    by token, as `ray start` does by default: a submitting shell without RAY_AUTH_MODE=token is
    refused, one with it (and the token's path) runs the job."""
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    with_token = {**ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    project = tmp_path / "project"
    for name in ("engine", "stages", "pipelines"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(f"raise ImportError('the user\\'s own {name} was imported')\n")
    (project / "my_reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):"
                                          "\n    return float(solution_str.strip() == ground_truth)\n")
    c = cluster(nodes=1, cpus=2, dashboard=True, env=with_token)
    runtime_env = yaml.safe_load((ROOT / "conf" / "ray" / "runtime_env.yaml").read_text())
    runtime_env["working_dir"] = str(project)
    runtime_env["env_vars"]["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path}/mlflow.db"
    url = f"http://127.0.0.1:{c.dashboard}"
    submit = [str(BIN / "ray"), "job", "submit", "--address", url, "--submission-id", "rlflow-smoke", "--no-wait",
              "--working-dir", str(project), "--runtime-env-json", json.dumps(runtime_env), "--",
              "rlflow", "train", "smoke", "reward.function=my_reward.py:compute_score",
              f"trainer.output_dir={tmp_path / 'out'}", "trainer.val_every=0"]
    without = {k: v for k, v in ENV.items() if k != "RAY_AUTH_MODE"}
    refused = subprocess.run(submit, env=without, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "token" in (refused.stdout + refused.stderr).lower(), refused.stderr[-2000:]
    proc = subprocess.run(submit, env=with_token, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    deadline, status = time.time() + 150, ""
    while time.time() < deadline:
        out = subprocess.run([str(BIN / "ray"), "job", "status", "--address", url, "rlflow-smoke"], env=with_token,
                             capture_output=True, text=True, timeout=60)
        status = (out.stdout + out.stderr).upper()  # the CLI writes its status line to stderr
        if any(s in status for s in ("SUCCEEDED", "FAILED", "STOPPED")):
            break
        time.sleep(2)
    logs = subprocess.run([str(BIN / "ray"), "job", "logs", "--address", url, "rlflow-smoke"], env=with_token,
                          capture_output=True, text=True, timeout=60).stdout
    assert "SUCCEEDED" in status, status[-1000:] + logs[-4000:]
    assert_three_steps(tmp_path / "mlflow.db")
