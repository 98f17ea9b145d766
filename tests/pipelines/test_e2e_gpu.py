"""End-to-end on GPUs: the real CLI, a local Ray cluster with GPU bundles, bf16."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def store(tmp_path: Path) -> str:
    return (f"sqlite:///{tmp_path}/mlflow.db" if importlib.util.find_spec("sqlalchemy")
            else f"file://{tmp_path}/mlruns")  # hosts with mlflow-skinny have no SQL store


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": store(tmp_path), "MLFLOW_ALLOW_FILE_STORE": "true"}
    cmd = [sys.executable, "-m", "rlflow.pipelines.cli", "train", str(ROOT / "conf" / "smoke.yaml"),
           f"trainer.output_dir={tmp_path}/out", "placement.gpus_per_worker=1", "model.dtype=bfloat16",
           "rollout.dtype=bfloat16", "trainer.val_every=0", *overrides]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_one_gpu_run_offloads_and_resumes(tmp_path):
    """Two steps with the optimizer offloaded and the KV cache freed while training, then a third
    from the checkpoint (torch DCP optimizer shards)."""
    first = train(tmp_path, "trainer.total_steps=2", "actor.offload_optimizer=true", "rollout.free_cache=true")
    assert "resumed from" not in first.stdout
    resumed = train(tmp_path, "trainer.total_steps=3")
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_checkpoint_from_two_gpus_resumes_on_one(tmp_path):
    train(tmp_path, "placement.workers=2", "trainer.total_steps=2")  # NCCL data parallel
    resumed = train(tmp_path, "placement.workers=1", "trainer.total_steps=3")
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_generate_tensor_parallel_and_agree_with_the_trainer(tmp_path, monkeypatch):
    """FSDP2 over 2 GPUs, generation as one TP group of 2 (NCCL all-reduce inside the decode
    graphs), resharded after every update; the train/infer mismatch is logged every step."""
    from mlflow import MlflowClient

    train(tmp_path, "placement.workers=2", "rollout.tp=2", "trainer.total_steps=3")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(store(tmp_path))
    run = client.search_runs([client.get_experiment_by_name("rlflow").experiment_id])[0]
    got = {k: [m.value for m in sorted(client.get_metric_history(run.info.run_id, f"training/rollout_probs_diff_{k}"),
                                       key=lambda m: m.step)] for k in ("mean", "max")}
    print(f"\nbf16, TP=2 over 2 GPUs, per step: rollout_probs_diff_mean {got['mean']}, max {got['max']}")
    assert len(got["mean"]) == 3 and max(got["mean"]) < 1e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_split_placement_trains_on_one_gpu_and_generates_on_another(tmp_path, monkeypatch):
    """One actor GPU, one rollout GPU; the weights go over NCCL after each update (the actor's update
    refuses a batch from any other version), and the rollout's probabilities stay near the trainer's."""
    from mlflow import MlflowClient

    train(tmp_path, "placement.own_pool=[rollout]", "trainer.total_steps=2")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(store(tmp_path))
    [run] = client.search_runs([client.get_experiment_by_name("rlflow").experiment_id])
    history = lambda key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))  # noqa: E731
    assert history("rollout/weight_version") == [(1, 0.0), (2, 1.0)]
    assert all(v < 0.1 for _, v in history("training/rollout_probs_diff_mean"))
