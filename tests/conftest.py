"""Shared fixtures: a real HF model directory and real parquet data, built locally."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import task


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A ~0.8M-parameter Qwen2 with the char tokenizer, saved as a HF directory."""
    return task.build_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="session")
def data_files(tmp_path_factory) -> dict[str, str]:
    return task.build_data(tmp_path_factory.mktemp("data"), n_train=512, n_val=64, seed=0)
