"""MLflow tracking: the one module in rlflow that talks to MLflow.

The driver builds one `Tracker`, logs through it and calls `finish`. Actors never log; they return
metrics to the driver.

Invariants:
- One run per driver. With `MLFLOW_RUN_ID` set (as `mlflow run` does) the tracker attaches to that
  run and never creates a second one.
- Every call names its run and tracking URI explicitly on an `MlflowClient`; no global MLflow state
  is read or set (`mlflow.set_tracking_uri` would also rewrite `MLFLOW_TRACKING_URI` in os.environ).
- Logging never stops training. Non-finite or non-numeric metric values are dropped and counted in
  `dropped_metrics`. A tracking failure logs ONE warning per outage; failed metrics stay in a
  bounded in-memory buffer and are sent first by the next `log_metrics` call made at least
  RETRY_AFTER_S later (and by `finish`). Each failed attempt still waits out MLflow's own HTTP
  retries: with the default MLFLOW_HTTP_REQUEST_MAX_RETRIES=7 that is about 4 minutes, so training
  jobs should set it low (e.g. 2).
- A metric has at most one value per step: a point at or below the highest step its key already
  has in the run (a resumed run, or a rebuilt job, replaying the steps after its checkpoint) is
  skipped, counted in `replayed_metrics`, and said once. MLflow cannot replace a point, and two
  values at one step draw a zigzag; on one machine the replay logs the same numbers anyway.
- One `log_batch` call per step (split only past MLflow's 1000-metrics-per-batch cap).
- Datasets are logged as run inputs (name, digest, source path) with their context (train, val,
  eval); the exported model is registered only when asked, as a transformers-flavor model.
- Names are sanitised to what MLflow accepts (`val/arith/acc` passes unchanged); param values are
  truncated with a visible "..." marker; params already on the run with the same value are
  skipped, so resuming a run does not error.

Run the tests: `python -m pytest tests/engine/test_tracking.py -q`
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import numbers
import os
import re
import tempfile
import time
import warnings
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from mlflow import MlflowClient
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking.context.registry import resolve_tags
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT, MLFLOW_LOGGED_ARTIFACTS
from mlflow.utils.validation import (
    MAX_ENTITY_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

log = logging.getLogger(__name__)

MAX_PENDING_METRICS = 100_000  # buffer cap during an outage; the oldest values go first
RETRY_AFTER_S = 60.0  # after a failed send, metrics only buffer for this long
SYSTEM_METRICS_INTERVAL_S = 10.0
SCHEMA_ROWS = 1000  # a logged dataset's schema is read off its first rows (log_datasets)
# MLflow wraps REST failures in MlflowException; requests' own errors (artifact uploads) are OSErrors.
TRACKING_ERRORS = (MlflowException, OSError)
_ILLEGAL = re.compile(r"[^\w\-. :/]")  # MLflow allows alphanumerics, _ - . space : /


def flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": [1, 2]} -> {"a.b": 1, "c": "[1, 2]"}."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name))
        else:
            out[name] = str(list(value)) if isinstance(value, (list, tuple)) else value
    return out


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"


def sanitise_name(name: str) -> str:
    """Map any key to a legal MLflow metric/param name; legal names pass unchanged."""
    # MLflow also rejects names that change under normpath ("a//b", "/a", "a/./b").
    parts = [p if p not in (".", "..") else "_" for p in _ILLEGAL.sub("_", str(name)).split("/") if p]
    return ("/".join(parts) or "_")[:MAX_ENTITY_KEY_LENGTH]


def _as_float(value: Any) -> float | None:
    """A finite float, or None for anything MLflow would reject (bool, str, NaN, inf)."""
    if hasattr(value, "item") and not isinstance(value, numbers.Number):
        try:
            value = value.item()  # 0-d tensors and numpy arrays
        except (ValueError, RuntimeError):
            return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _truncate(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_PARAM_VAL_LENGTH else text[: MAX_PARAM_VAL_LENGTH - 3] + "..."


class Tracker:
    """The driver's handle on its MLflow run."""

    def __init__(
        self,
        experiment: str = "rlflow",
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
        tracking_uri: str | None = None,
        system_metrics: bool = True,
    ) -> None:
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.client = MlflowClient(self.tracking_uri)
        self.dropped_metrics = 0
        self._pending: list[Metric] = []
        self._warned = False
        self._retry_at = 0.0  # time.monotonic() before which buffered metrics are not resent
        self._finished = False
        attach_id = os.environ.get("MLFLOW_RUN_ID")
        self._run_id = self._attach(attach_id) if attach_id else self._create(experiment, run_name, tags)
        self.replayed_metrics, self._said_replay = 0, False
        self._last_step = self._logged_steps() if attach_id else {}  # per metric key, its highest step
        if attach_id and tags:
            self.set_tags(tags)
        self._monitor = self._start_system_metrics(resume=bool(attach_id)) if system_metrics else None

    @property
    def run_id(self) -> str:
        return self._run_id

    def local_artifacts(self) -> bool:
        """Whether this run's artifacts are files on this machine (a local store), not uploads."""
        try:
            uri = self.client.get_run(self._run_id).info.artifact_uri
        except MlflowException:
            return False
        return urlparse(uri).scheme in ("", "file")

    def _attach(self, run_id: str) -> str:
        if self.client.get_run(run_id).info.status != "RUNNING":  # resuming a terminated run
            self.client.update_run(run_id, status="RUNNING")
        return run_id

    def _logged_steps(self) -> dict[str, int]:
        """Each metric key's highest step in the run (MLflow's system metrics left out: their own clock)."""
        keys = [k for k in self.client.get_run(self._run_id).data.metrics if not k.startswith("system/")]
        return {k: max(m.step for m in self.client.get_metric_history(self._run_id, k)) for k in keys}

    def _create(self, experiment: str, run_name: str | None, tags: dict[str, str] | None) -> str:
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        # resolve_tags adds the user, source and git commit tags that mlflow.start_run would.
        return self.client.create_run(exp_id, run_name=run_name, tags=resolve_tags(tags)).info.run_id

    def _start_system_metrics(self, resume: bool) -> Any:
        if importlib.util.find_spec("psutil") is None:  # the monitor samples through psutil
            return None
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            self._run_id, SYSTEM_METRICS_INTERVAL_S, resume_logging=resume, tracking_uri=self.tracking_uri
        )
        monitor.start()
        return monitor

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> bool:
        """Run one MLflow call; on failure warn once per outage instead of raising."""
        try:
            fn(*args, **kwargs)
        except TRACKING_ERRORS as e:  # a tracking outage must not kill training
            self._warn(e)
            return False
        self._warned = False
        return True

    def _warn(self, error: Exception) -> None:
        if not self._warned:
            log.warning("MLflow tracking failed, training continues and metrics are retried: %s", error)
        self._warned = True

    def log_params(self, params: Mapping[str, Any]) -> None:
        flat = {sanitise_name(k): _truncate(v) for k, v in flatten(params).items()}
        try:
            existing = self.client.get_run(self._run_id).data.params
        except TRACKING_ERRORS as e:
            return self._warn(e)
        changed = ", ".join(f"{k}: {existing[k]} -> {flat[k]}" for k in sorted(flat)
                            if k in existing and existing[k] != flat[k])
        if changed:  # a resumed run, run again with other settings: MLflow keeps a param's first value
            log.warning("MLflow run %s was started with other settings, which its params keep; what this "
                        "command changed is in its tag params_changed: %s", self._run_id, changed)
            self.set_tags({"params_changed": _truncate(changed)})
        self._log_batches("params", [Param(k, v) for k, v in flat.items() if k not in existing])

    def _log_batches(self, kind: str, entities: list[Any]) -> None:
        """Params or tags, in batches of MLflow's 100-per-call cap."""
        for i in range(0, len(entities), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = entities[i : i + MAX_PARAMS_TAGS_PER_BATCH]
            self._guard(self.client.log_batch, self._run_id, **{kind: chunk})

    def log_metrics(self, metrics: Mapping[str, float], step: int, again: bool = False) -> None:
        """`metrics` at `step`; a key that already has a point at `step` or later skips it, unless
        `again` (an event that may recur at one step, e.g. a restart)."""
        now_ms = int(time.time() * 1000)
        for key, value in metrics.items():
            number, name = _as_float(value), sanitise_name(key)
            if number is None:
                self.dropped_metrics += 1
            elif step <= self._last_step.get(name, -1) and not again:
                if step > 0 and not self._said_replay:  # step 0: what every start logs (data counts)
                    self._said_replay = True
                    log.warning("MLflow run %s already has steps %d to %d, logged before the run was interrupted: "
                                "their replay from the checkpoint keeps those values", self._run_id, step,
                                self._last_step[name])
                self.replayed_metrics += 1
            else:
                self._pending.append(Metric(name, number, now_ms, int(step)))
                self._last_step[name] = max(step, self._last_step.get(name, -1))
        if len(self._pending) > MAX_PENDING_METRICS:
            self.dropped_metrics += len(self._pending) - MAX_PENDING_METRICS
            del self._pending[:-MAX_PENDING_METRICS]
        if time.monotonic() >= self._retry_at:
            self._flush()

    def _flush(self) -> None:
        while self._pending:
            chunk = self._pending[:MAX_METRICS_PER_BATCH]
            if not self._guard(self.client.log_batch, self._run_id, metrics=chunk):
                self._retry_at = time.monotonic() + RETRY_AFTER_S
                return
            del self._pending[: len(chunk)]

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows of samples -> a .json table artifact, as MLflow's `log_table` writes one (shown in
        its UI's table view); an existing file is replaced (MLflow's would append: a replayed step's
        samples twice)."""
        import pandas as pd

        columns = list(dict.fromkeys(k for row in rows for k in row))
        if not columns:
            return
        table = pd.DataFrame({c: [row.get(c) for row in rows] for c in columns}).to_json(orient="split", index=False)
        if self._guard(self.client.log_text, self._run_id, table, artifact_file):
            self._guard(self._list_table, artifact_file)

    def _list_table(self, artifact_file: str) -> None:
        """Name `artifact_file` in the run's tag of table artifacts, as `MlflowClient.log_table` does."""
        listed = json.loads(self.client.get_run(self._run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
        if {"path": artifact_file, "type": "table"} not in listed:
            listed.append({"path": artifact_file, "type": "table"})
            self.client.set_tag(self._run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps(listed))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        """A file, or a directory's contents, under `artifact_path` (as MLflow's log_artifacts does)."""
        log_fn = self.client.log_artifacts if os.path.isdir(path) else self.client.log_artifact
        self._guard(log_fn, self._run_id, path, artifact_path)

    def log_dict(self, d: dict, artifact_file: str) -> None:
        """Written as yaml for .yaml/.yml, json otherwise."""
        self._guard(self.client.log_dict, self._run_id, d, artifact_file)

    def set_tags(self, tags: dict[str, str]) -> None:
        self._log_batches("tags", [RunTag(k, str(v)) for k, v in tags.items()])

    def log_datasets(self, files: Mapping[str, list[str]]) -> None:
        """Each data file as a run input, tagged with its context ({"train": [paths], "val": [...]}).

        The schema is read off the first `SCHEMA_ROWS` rows, as MLflow's digest is off the first
        10,000 (and the row count): inferred over every row, it held up the start of a run by a time
        that grows with the file. The profile counts every row."""
        import pandas as pd
        from mlflow.data.pandas_dataset import from_pandas

        from rlflow.engine.data.prompts import read_rows

        inputs = []
        for context, paths in files.items():
            for path in paths:
                with warnings.catch_warnings():  # MLflow registers its local-file source twice and says so
                    warnings.filterwarnings("ignore", "The specified dataset source can be interpreted")
                    frame = pd.DataFrame(read_rows(path))
                    where = {"source": os.path.abspath(path), "name": os.path.basename(path)}
                    dataset = from_pandas(frame, **where)
                    # `schema` is a functools.cached_property: filled in here, it is not inferred again
                    dataset.__dict__["schema"] = from_pandas(frame.head(SCHEMA_ROWS), **where).schema
                tags = [InputTag(MLFLOW_DATASET_CONTEXT, context)]
                inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags))
        self._guard(self.client.log_inputs, self._run_id, datasets=inputs)

    def register_model(self, hf_dir: str, name: str) -> str:
        """Log a HF directory as a transformers-flavor model under `model/` and register it as a new
        version of `name` in the Model Registry; returns the version. Raises when registration fails."""
        import mlflow.transformers
        import torch
        import transformers

        path = os.path.abspath(hf_dir)  # an absolute path is never looked up as a Hub repo id
        parts = {"model": transformers.AutoModelForCausalLM.from_pretrained(path),
                 "tokenizer": transformers.AutoTokenizer.from_pretrained(path)}
        # Stated, not inferred: MLflow's inference probes the environment in a subprocess and wants torchvision.
        requirements = [f"transformers=={transformers.__version__}", f"torch=={torch.__version__.split('+')[0]}"]
        with tempfile.TemporaryDirectory() as tmp:
            mlflow.transformers.save_model(parts, f"{tmp}/model", task="text-generation",
                                           pip_requirements=requirements)
            self.client.log_artifacts(self._run_id, f"{tmp}/model", "model")
        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        return str(self.client.create_model_version(name, f"runs:/{self._run_id}/model", self._run_id).version)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run (FINISHED, FAILED or KILLED). A second call does nothing."""
        if self._finished:
            return
        self._finished = True
        self._flush()
        if self._pending:
            log.warning("%d metric values could not be sent and are lost", len(self._pending))
        if self._monitor is not None:
            self._monitor.finish()
        self._guard(self.client.set_terminated, self._run_id, status)
