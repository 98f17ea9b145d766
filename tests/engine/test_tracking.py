"""Tests for engine/tracking.py against a sqlite store and a real `mlflow server` on loopback."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
from transformers import AutoModelForCausalLM

from rlflow.engine import tracking
from rlflow.engine.tracking import Tracker, flatten, sanitise_name


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # a sqlite store puts artifacts under ./mlruns


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module: creating its schema takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('sqlite')}/m.db"


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_flatten_nests_with_dots_and_stringifies_sequences() -> None:
    assert flatten({"a": {"b": {"c": 1}}, "d": [1, 2], "e": (3,), "f": None}) == {
        "a.b.c": 1,
        "d": "[1, 2]",
        "e": "[3]",
        "f": None,
    }


def test_sanitise_name_keeps_legal_names_and_fixes_illegal_ones() -> None:
    for legal in ["val/arith/acc", "timing_s/gen", "perf/mfu/actor", "a-b.c d:e"]:
        assert sanitise_name(legal) == legal
    assert sanitise_name("acc@k=5") == "acc_k_5"
    assert sanitise_name("/a//b/./c/") == "a/b/_/c"
    assert sanitise_name("") == "_"


def test_default_tracking_uri(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert tracking.default_tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    assert tracking.default_tracking_uri() == "http://127.0.0.1:1"


def test_sqlite_run_records_params_metrics_and_artifacts(uri: str, tmp_path: Path) -> None:
    t = Tracker("exp", run_name="r1", tags={"algo": "grpo"}, tracking_uri=uri, system_metrics=False)
    params = {
        "model": {"name": "tiny", "layers": [1, 2]},
        "lr": 1e-3,
        "prompt": "x" * 10_000,
        "many": {str(i): i for i in range(150)},  # over MLflow's 100 params per batch
    }
    t.log_params(params)
    t.log_params(params)  # resuming re-logs the same config: skipped, no error
    t.log_params({**params, "lr": 2e-3})  # resumed with another setting: kept, and the change tagged
    for step in range(3):
        bad: dict[str, Any] = {"nan": math.nan, "inf": math.inf, "s": "x"}  # dropped, counted
        t.log_metrics({"val/arith/acc": step / 10, **bad}, step)
    t.log_table([{"prompt": "1+1", "response": "2"}, {"prompt": "2+2", "reward": 1.0}], "samples/step_0.json")
    ckpt = tmp_path / "ckpt" / "step_2"
    ckpt.mkdir(parents=True)
    (ckpt / "model.bin").write_bytes(b"\0" * 8)
    t.log_artifact(str(ckpt), "checkpoints/step_2")
    t.log_dict({"trainer": {"steps": 3}}, "config.yaml")
    t.finish()
    t.finish()  # second call is a no-op

    client = MlflowClient(uri)
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert run.data.tags["algo"] == "grpo"
    p = run.data.params
    assert p["model.name"] == "tiny" and p["model.layers"] == "[1, 2]" and p["lr"] == "0.001"
    assert run.data.tags["params_changed"] == "lr: 0.001 -> 0.002"
    assert len(p["prompt"]) == MAX_PARAM_VAL_LENGTH and p["prompt"].endswith("...")
    assert len(p) == 4 + 150 and p["many.149"] == "149"
    assert history(client, t.run_id, "val/arith/acc") == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert set(run.data.metrics) == {"val/arith/acc"} and t.dropped_metrics == 9
    assert [a.path for a in client.list_artifacts(t.run_id, "samples")] == ["samples/step_0.json"]
    assert [a.path for a in client.list_artifacts(t.run_id, "checkpoints/step_2")] == [
        "checkpoints/step_2/model.bin"
    ]
    config = Path(client.download_artifacts(t.run_id, "config.yaml", str(tmp_path)))
    assert config.read_text() == "trainer:\n  steps: 3\n"


def test_a_resumed_run_keeps_one_value_per_step_and_one_table_per_file(
        uri: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    first = Tracker(tracking_uri=uri, system_metrics=False)
    for step in (1, 2, 3):  # then the job dies; its checkpoint was at step 1
        first.log_metrics({"loss": float(step)}, step)
    first.log_table([{"prompt": "p", "response": "old"}], "samples/step_2.json")
    first.finish("KILLED")

    monkeypatch.setenv("MLFLOW_RUN_ID", first.run_id)  # what a resume attaches to
    again = Tracker(tracking_uri=uri, system_metrics=False)
    for step in (2, 3, 4):  # the replay of steps 2 and 3, then new ground
        again.log_metrics({"loss": 10.0 + step, "new": 1.0}, step)
    again.log_metrics({"restarts": 1.0}, 4)
    again.log_metrics({"restarts": 2.0}, 4, again=True)  # an event may recur at one step
    again.log_table([{"prompt": "p", "response": "new"}], "samples/step_2.json")
    again.finish()

    client = MlflowClient(uri)
    assert history(client, first.run_id, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0)]
    assert history(client, first.run_id, "new") == [(2, 1.0), (3, 1.0), (4, 1.0)]  # a key of its own
    assert history(client, first.run_id, "restarts") == [(4, 1.0), (4, 2.0)]
    assert again.replayed_metrics == 2
    table = json.loads(Path(client.download_artifacts(first.run_id, "samples/step_2.json", str(tmp_path))).read_text())
    assert table == {"columns": ["prompt", "response"], "data": [["p", "new"]]}  # replaced, not appended
    listed = json.loads(client.get_run(first.run_id).data.tags["mlflow.loggedArtifacts"])
    assert listed == [{"path": "samples/step_2.json", "type": "table"}]


def test_one_log_batch_call_per_step_split_past_mlflow_cap(uri: str) -> None:
    t = Tracker(tracking_uri=uri, system_metrics=False)
    calls: list[int] = []
    log_batch = t.client.log_batch

    def counting_log_batch(run_id: str, metrics: list) -> None:
        calls.append(len(metrics))
        log_batch(run_id, metrics)

    t.client.log_batch = counting_log_batch  # type: ignore[method-assign,assignment]
    t.log_metrics({f"m/{i}": float(i) for i in range(20)}, step=0)
    t.log_metrics({f"m/{i}": float(i) for i in range(1500)}, step=1)
    assert calls == [20, 1000, 500]
    t.finish()
    assert history(MlflowClient(uri), t.run_id, "m/1499") == [(1, 1499.0)]


class DownClient:
    """Stands in for an MlflowClient whose server is unreachable."""

    def __init__(self) -> None:
        self.attempts = 0

    def log_batch(self, run_id: str, metrics: list) -> None:
        self.attempts += 1
        raise MlflowException("connection refused")

    def set_terminated(self, run_id: str, status: str) -> None:
        raise MlflowException("connection refused")


def test_outage_retries_at_most_once_per_interval_and_finish_tries_again(
    uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    t = Tracker(tracking_uri=uri, system_metrics=False)
    t.client = down = DownClient()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="rlflow.engine.tracking"):
        for step in range(5):
            t.log_metrics({"actor/grad_norm": 1.0}, step)  # must not raise
        assert down.attempts == 1  # the other steps only buffer: each attempt can block on retries
        t.finish()
    assert down.attempts == 2
    assert [r.levelname for r in caplog.records if r.name == "rlflow.engine.tracking"] == ["WARNING"] * 2


def test_attaches_to_mlflow_run_id_and_creates_no_second_run(
    uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = MlflowClient(uri)
    exp_id = client.create_experiment("attach")
    run_id = client.create_run(exp_id).info.run_id
    client.set_terminated(run_id, "FAILED")  # a previous attempt that crashed
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)

    t = Tracker("attach", tracking_uri=uri, system_metrics=False)
    assert t.run_id == run_id and client.get_run(run_id).info.status == "RUNNING"
    t.log_metrics({"actor/pg_loss": 0.5}, step=7)
    t.finish()

    runs = client.search_runs([exp_id])
    assert [r.info.run_id for r in runs] == [run_id]
    assert runs[0].info.status == "FINISHED" and runs[0].data.metrics == {"actor/pg_loss": 0.5}


def test_system_metrics_are_logged_to_the_run(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("psutil")
    monkeypatch.setattr(tracking, "SYSTEM_METRICS_INTERVAL_S", 0.2)
    t = Tracker(tracking_uri=uri)
    time.sleep(1.0)
    t.finish()
    metrics = MlflowClient(uri).get_run(t.run_id).data.metrics
    assert any(k.startswith("system/cpu") for k in metrics), metrics


class MlflowServer:
    """`mlflow server` on 127.0.0.1; stop/start keep the port and the store."""

    def __init__(self, root: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.root, self.url = root, f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        args = f"-m mlflow server --host 127.0.0.1 --port {self.port} --workers 1".split()
        store = ["--backend-store-uri", f"sqlite:///{self.root}/server.db"]
        artifacts = ["--artifacts-destination", str(self.root / "artifacts")]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner processes
        log = open(self.root / "server.log", "ab")  # noqa: SIM115  (lives as long as the server)
        self.proc = subprocess.Popen(
            [sys.executable, *args, *store, *artifacts],
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )

    def wait_healthy(self, timeout_s: float = 45.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.proc is not None and self.proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        pytest.fail(f"mlflow server did not come up:\n{(self.root / 'server.log').read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the server runs uvicorn as a child process
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module", autouse=True)
def _server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """Launched when the module starts, so the server boots while the sqlite tests run."""
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    srv.launch()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def server(_server_process: MlflowServer) -> MlflowServer:
    _server_process.wait_healthy()
    return _server_process


@pytest.mark.timeout(60)
def test_http_server_roundtrip(server: MlflowServer) -> None:
    t = Tracker("http", tracking_uri=server.url, system_metrics=False)
    t.log_params({"algo": {"name": "grpo"}})
    for step in range(3):
        t.log_metrics({"critic/score/mean": float(step), "timing_s/step": 0.1}, step)
    t.log_table([{"prompt": "p", "response": "r"}], "samples/step_2.json")
    t.finish()

    client = MlflowClient(server.url)
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"algo.name": "grpo"}
    assert history(client, t.run_id, "critic/score/mean") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert [a.path for a in client.list_artifacts(t.run_id, "samples")] == ["samples/step_2.json"]


@pytest.mark.timeout(60)
def test_outage_buffers_metrics_warns_once_and_flushes_after_restart(
    server: MlflowServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setattr(tracking, "RETRY_AFTER_S", 0.0)
    t = Tracker("outage", tracking_uri=server.url, system_metrics=False)
    t.log_metrics({"actor/entropy": 0.0}, step=0)

    server.stop()
    with caplog.at_level(logging.WARNING, logger="rlflow.engine.tracking"):
        for step in range(1, 4):
            t.log_metrics({"actor/entropy": float(step)}, step)  # must not raise
    assert len([r for r in caplog.records if r.name == "rlflow.engine.tracking"]) == 1

    server.launch()
    server.wait_healthy()
    t.log_metrics({"actor/entropy": 4.0}, step=4)
    t.finish()
    client = MlflowClient(server.url)
    assert history(client, t.run_id, "actor/entropy") == [(s, float(s)) for s in range(5)]
    assert client.get_run(t.run_id).info.status == "FINISHED"


def test_datasets_are_run_inputs_with_digest_source_and_context(uri: str, data_files: dict[str, str],
                                                                tmp_path: Path) -> None:
    jsonl = tmp_path / "extra.jsonl"
    jsonl.write_text('{"data_source": "arith", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}\n')
    t = Tracker("inputs", tracking_uri=uri, system_metrics=False)
    t.log_datasets({"train": [data_files["train"], str(jsonl)], "val": [data_files["val"]]})
    t.finish()

    inputs = MlflowClient(uri).get_run(t.run_id).inputs.dataset_inputs
    got = {(i.dataset.name, i.tags[0].value): i.dataset for i in inputs}
    assert set(got) == {("train.parquet", "train"), ("extra.jsonl", "train"), ("val.parquet", "val")}
    train = got["train.parquet", "train"]
    assert train.source_type == "local" and data_files["train"] in train.source
    assert '"num_rows": 512' in train.profile and len(train.digest) == 8
    columns = {c["name"] for c in json.loads(train.schema)["mlflow_colspec"]}
    assert {"prompt", "data_source", "reward_model"} <= columns, columns
    assert got["val.parquet", "val"].digest != train.digest


def test_register_model_makes_a_loadable_transformers_model_version(
    uri: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.transformers

    versions = []
    for _ in range(2):  # a second registration adds a version to the same model
        t = Tracker("registry", tracking_uri=uri, system_metrics=False)
        versions.append(t.register_model(str(model_dir), "tiny-policy"))
        t.finish()
    client = MlflowClient(uri)
    assert versions == ["1", "2"]
    latest = client.get_model_version("tiny-policy", "2")
    assert latest.run_id == t.run_id and latest.status == "READY"
    flavors = client.download_artifacts(t.run_id, "model/MLmodel")
    assert "transformers:" in Path(flavors).read_text() and "task: text-generation" in Path(flavors).read_text()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # models:/ URIs resolve through the tracking URI
    parts = mlflow.transformers.load_model("models:/tiny-policy/2", return_type="components")
    assert parts["model"].num_parameters() == AutoModelForCausalLM.from_pretrained(model_dir).num_parameters()
