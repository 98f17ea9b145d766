"""Models and data by Hub id, offline, against a Hugging Face cache filled as a download fills it:
a cached id resolves to its snapshot, a missing one is one line before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import plant

from rlflow.engine import hub

BIN = Path(sys.executable).parent


@pytest.fixture
def offline(monkeypatch, hub_cache):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache[0]))
    return hub_cache


def offline_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "MLFLOW_TRACKING_URI":
            f"sqlite:///{cache.parent}/mlflow.db"}


def test_what_is_an_id_and_what_is_a_directory(tmp_path, model_dir, monkeypatch):
    assert hub.is_id("Qwen/Qwen2.5-0.5B-Instruct") and hub.is_id("Qwen/Qwen2.5-0.5B-Instruct@v1.0")
    assert not hub.is_id(str(model_dir)) and not hub.is_id("/models/x") and not hub.is_id("./a/b")
    assert not hub.is_id("a/b/c") and not hub.is_id("embedded")
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # a relative directory that exists is a directory, whatever it looks like
    assert not hub.is_id("org/model")


def test_a_cached_model_id_resolves_offline_to_its_snapshot(offline, tmp_path, model_dir):
    cache, repo = offline
    path = hub.fetch(repo)
    assert Path(path) == cache / "models--rlflow-test--tiny-qwen2" / "snapshots" / ("a" * 40)
    assert (Path(path) / "config.json").is_file() and hub.commit(path) == "a" * 40
    assert hub.fetch(f"{repo}@{'a' * 40}") == path  # a pinned commit
    assert hub.local(path) == path  # present on this node: nothing fetched
    # another node's cache: the same commit, fetched into this one
    elsewhere = f"/nodes/b/hf/hub/models--rlflow-test--tiny-qwen2/snapshots/{'a' * 40}"
    assert hub.local(elsewhere) == path
    with pytest.raises(hub.HubError, match="rlflow-test/missing: not in the Hugging Face cache"):
        hub.fetch("rlflow-test/missing")
    weightless = plant(cache, "rlflow-test/no-weights", tmp_path, commit="b" * 40)
    (weightless / "config.json").write_text("{}")
    with pytest.raises(hub.HubError, match="no safetensors weights"):
        hub.fetch("rlflow-test/no-weights")


def test_a_missing_model_id_is_one_line_before_ray_or_mlflow_start(hub_cache, tmp_path):
    cache, _ = hub_cache
    (tmp_path / "t.jsonl").write_text('{"prompt": "1+1=", "data_source": "openai/gsm8k", '
                                      '"reward_model": {"ground_truth": "2"}}\n')
    start = time.time()
    proc = subprocess.run([str(BIN / "rlflow"), "train", "gsm8k", "model.path=rlflow-test/missing",
                           f"data.train_files=[{tmp_path / 't.jsonl'}]", f"data.val_files=[{tmp_path / 't.jsonl'}]"],
                          env=offline_env(cache), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "config error: model.path=rlflow-test/missing: not in the Hugging Face cache" in proc.stderr
    assert not (cache.parent / "mlflow.db").exists() and time.time() - start < 60


GSM8K_ROWS = [{"question": "Tom has 2 apples and buys 3 more. How many?", "answer": "2+3=5\n#### 5"},
              {"question": "What is 1,000 + 234?", "answer": "#### 1,234"}]


def test_rlflow_data_fetches_gsm8k_from_the_cache_and_a_missing_dataset_is_one_line(tmp_path):
    cache, files = tmp_path / "hf" / "hub", tmp_path / "files"
    (files / "main").mkdir(parents=True)
    pd.DataFrame(GSM8K_ROWS).to_parquet(files / "main" / "train-00000-of-00001.parquet")
    pd.DataFrame(GSM8K_ROWS[:1]).to_parquet(files / "main" / "test-00000-of-00001.parquet")
    plant(cache, "openai/gsm8k", files, kind="dataset")
    proc = subprocess.run([str(BIN / "rlflow"), "data", "gsm8k", str(tmp_path / "out")], env=offline_env(cache),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    train, test = (pd.read_parquet(tmp_path / "out" / f"{s}.parquet") for s in ("train", "test"))
    assert [r["ground_truth"] for r in train["reward_model"]] == ["5", "1234"] and len(test) == 1
    assert set(train["data_source"]) == {"openai/gsm8k"} and "wrote 2 of 2 rows" in proc.stdout
    missing = subprocess.run([str(BIN / "rlflow"), "data", "math", str(tmp_path / "m")], env=offline_env(cache),
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "DigitalLearningGmbH/MATH-lighteval: not in the Hugging Face cache" \
        in missing.stderr and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
