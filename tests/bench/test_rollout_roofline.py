"""bench/rollout.py's roofline: the matmuls it counts are the model's, and counting their FLOPs
only ever lowers the roofline, to where they take longer than reading the weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import rollout  # noqa: E402
from shapes import QWEN25, TINY  # noqa: E402

from rlflow.engine.rollout.model import FusedLinear, NativeCausalLM, RowLinear  # noqa: E402


@pytest.mark.parametrize("shape", [TINY, {**TINY, "tie_word_embeddings": False}, QWEN25["qwen2.5-1.5b"]])
def test_the_counted_matmuls_are_the_models_projections_and_head(shape):
    cfg = Qwen2Config(**shape)
    with torch.device("meta"):
        model = NativeCausalLM(cfg)
    projections = sum(m.weight.numel() for m in model.modules() if isinstance(m, (FusedLinear, RowLinear)))
    head = (model.model.embed_tokens if model.lm_head is None else model.lm_head).weight.numel()
    assert rollout.matmul_params(cfg) == (projections, head)


def test_arithmetic_lowers_the_roofline_only_where_it_outlasts_the_weights():
    cfg = Qwen2Config(**QWEN25["qwen2.5-0.5b"])
    weight_bytes, tbps = 2 * sum(rollout.matmul_params(cfg)), 3.0
    read = weight_bytes / (tbps * 1e12)
    bytes_only = rollout.roofline(cfg, weight_bytes, 1024, 128, 256, 2, tbps)
    assert rollout.roofline(cfg, weight_bytes, 1024, 128, 256, 2, tbps, read / 2) == bytes_only
    slower = rollout.roofline(cfg, weight_bytes, 1024, 128, 256, 2, tbps, 3 * read)
    assert slower < bytes_only
    # the step's time grew by exactly the matmuls' excess over the read
    assert 1024 / slower - 1024 / bytes_only == pytest.approx(2 * read)


def test_matmuls_add_only_on_steps_with_rows_enough():
    # answers of 1, 2 and 4 steps: 3 rows, then 2, then 1 twice
    assert rollout.matmul_excess([1, 2, 4], weight_s=1.0, row_s=0.5) == pytest.approx(0.5)
    assert rollout.matmul_excess([1, 2, 4], weight_s=1.0, row_s=1.0) == pytest.approx(2 + 1)
    assert rollout.matmul_excess([1, 2, 4], weight_s=3.0, row_s=1.0) == 0.0


@pytest.mark.parametrize("fp8", [False, True])
def test_the_matmul_rate_is_measured_in_bf16_and_as_the_fp8_engine_multiplies(fp8):
    from shapes import matmul_tflops
    assert 0 < matmul_tflops(fp8=fp8, n=64, device="cpu") < float("inf")
