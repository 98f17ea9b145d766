"""`rlflow eval` on a saved tiny model: the real CLI, real generation, a real sqlite MLflow store."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rlflow.engine.config import load_config
from rlflow.engine.data.prompts import embedded_files
from rlflow.pipelines.cli import eval_files
from rlflow.pipelines.grpo import summarise

BIN = Path(sys.executable).parent

# An untrained model's first character is close to a coin flip under this reward, so accuracy,
# mean@k and pass@k all land strictly between 0 and 1 for the "coin" rows.
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(data_source == "coin" and solution_str[:1] != "" and ord(solution_str[0]) % 2 == 1)
"""


def row(source: str, a: int) -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": f"{a}+{a}="}],
            "reward_model": {"ground_truth": str(2 * a)}}


def pass_at(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_summarise_per_source_and_overall() -> None:
    m = summarise("eval/", ["a", "a", "b"], [1.0, 0.0, 1.0], [[1.0, 0.0, 0.0, 0.0], [0.0] * 4, [1.0, 1.0, 0.5, 0.0]])
    assert m["eval/a/accuracy"] == 0.5 and m["eval/b/accuracy"] == 1.0 and m["eval/accuracy"] == 2 / 3
    assert m["eval/a/mean_at_4"] == pytest.approx(0.125) and m["eval/b/mean_at_4"] == pytest.approx(0.625)
    # a: c=1 and c=0 of 4; b: c=2 of 4 (0.5 is not correct)
    assert m["eval/a/pass_at_2"] == pytest.approx((1 - 3 / 6) / 2)
    assert m["eval/b/pass_at_2"] == pytest.approx(1 - 1 / 6)
    assert m["eval/pass_at_4"] == pytest.approx(2 / 3)
    assert set(k for k in m if k.startswith("eval/a/")) == {
        "eval/a/prompts", "eval/a/greedy_score", "eval/a/accuracy", "eval/a/mean_at_4", "eval/a/pass_at_1",
        "eval/a/pass_at_2", "eval/a/pass_at_4"}
    # without samples (training validation with trainer.val_samples=0): the greedy numbers only
    assert summarise("val/", ["a"], [0.5], []) == {
        "val/prompts": 1.0, "val/greedy_score": 0.5, "val/accuracy": 0.0,
        "val/a/prompts": 1.0, "val/a/greedy_score": 0.5, "val/a/accuracy": 0.0}


@pytest.mark.timeout(300)
def test_rlflow_eval_logs_its_own_run_with_metrics_per_data_source(model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(row(s, a)) + "\n" for s in ("coin", "never") for a in range(6)))
    (tmp_path / "reward.py").write_text(REWARD)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "rlflow.pipelines.cli", "eval", str(model_dir), f"data.val_files=[{data}]",
           "rollout.samples_per_prompt=6", "rollout.max_new_tokens=3", "trainer.experiment=evals",
           f"reward.function={tmp_path}/reward.py:compute_score", f"trainer.output_dir={tmp_path}/out"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pass@6" in proc.stdout and "coin" in proc.stdout

    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("evals").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["job"] == "eval"
    assert run.data.params["rollout.samples_per_prompt"] == "6"
    [dataset] = run.inputs.dataset_inputs
    assert dataset.dataset.name == "eval.jsonl" and dataset.tags[0].value == "eval"
    m = run.data.metrics
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "eval/prompts.json", str(tmp_path))).read_text())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    coin = [r for r in rows if r["data_source"] == "coin"]
    assert len(coin) == 6 and m["eval/coin/prompts"] == 6 and m["eval/prompts"] == 12
    # the logged greedy score is the reward of the logged greedy response
    for r in coin:
        assert r["greedy_score"] == float(ord(r["greedy_response"][0]) % 2 == 1)
    assert m["eval/coin/accuracy"] == sum(r["greedy_score"] for r in coin) / 6
    for k in (1, 2, 4, 6):  # the per-prompt counts, through the textbook binomial formula
        assert m[f"eval/coin/pass_at_{k}"] == pytest.approx(sum(pass_at(6, r["sampled_correct"], k) for r in coin) / 6)
        assert m[f"eval/never/pass_at_{k}"] == 0.0
        assert m[f"eval/pass_at_{k}"] == pytest.approx(m[f"eval/coin/pass_at_{k}"] / 2)
    assert m["eval/coin/mean_at_6"] == pytest.approx(m["eval/coin/pass_at_1"])  # 0/1 scores
    assert 0 < m["eval/coin/pass_at_1"] < m["eval/coin/pass_at_6"] <= 1  # sampling finds more than one try
    assert m["eval/reward_errors"] == 0


@pytest.mark.timeout(300)
def test_rlflow_eval_of_a_run_uses_that_runs_embedded_held_out_set(model_dir: Path, tmp_path: Path) -> None:
    """A run of trainer.seed=1 holds its own embedded set. Evaluated from elsewhere with the default
    trainer.output_dir and seed, eval must use that set, not build seed 0's under ./outputs/rlflow:
    seed 0's held-out prompts are partly seed 1's training prompts."""
    run = tmp_path / "run"
    val = embedded_files(run / "embedded", seed=1)["val"]  # what a run with trainer.seed=1 built
    shutil.copytree(model_dir, run / "hf_model")  # and its exported model
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "rlflow.pipelines.cli", "eval", str(run / "hf_model"), "data.val_max_prompts=4",
           "rollout.samples_per_prompt=2", "rollout.max_new_tokens=3", "trainer.experiment=evals"]
    proc = subprocess.run(cmd, env={**os.environ, "MLFLOW_TRACKING_URI": uri}, cwd=elsewhere,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"embedded held-out set of {run}: {val}" in proc.stdout
    client = MlflowClient(uri)
    [evaluated] = client.search_runs([client.get_experiment_by_name("evals").experiment_id])
    [dataset] = evaluated.inputs.dataset_inputs
    assert json.loads(dataset.dataset.source)["uri"] == val
    assert not (elsewhere / "outputs" / "rlflow" / "embedded").exists()


def test_eval_outside_a_run_warns_and_an_explicit_output_dir_wins(model_dir: Path, tmp_path: Path, monkeypatch,
                                                                   capsys) -> None:
    monkeypatch.chdir(tmp_path)
    [val] = eval_files(model_dir, load_config())  # a model in no run directory: today's set, with a warning
    assert Path(val).resolve() == tmp_path / "outputs" / "rlflow" / "embedded" / "data" / "val.parquet"
    assert "rlflow: warning:" in capsys.readouterr().out
    run = tmp_path / "run"
    shutil.copytree(model_dir, run / "hf_model")
    embedded_files(run / "embedded", seed=1)
    cfg = load_config()
    cfg.trainer.output_dir = str(tmp_path / "outputs" / "rlflow")  # given explicitly: the user's choice
    assert [Path(f).resolve() for f in eval_files(run / "hf_model", cfg)] == [Path(val).resolve()]
