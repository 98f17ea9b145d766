"""The reward stage: rule functions scoring decoded responses against ground truth.

Verb: `score(batch) -> batch` filling `scores` [N] (and `baseline_scores` [N] when the batch
carries ReMax's greedy answers) and `reward/*` metrics. A failing user function
scores 0 and is counted (`reward/errors`) unless `reward.on_error=raise`.
"""

from __future__ import annotations

import time

import torch

from engine.batch import Batch
from engine.config import Config
from engine.rewards import RewardFunction


class Reward:
    def __init__(self, cfg: Config) -> None:
        self.fn = RewardFunction(cfg.reward.function, cfg.reward.on_error, cfg.reward.timeout_s)

    def score(self, batch: Batch) -> Batch:
        start = time.perf_counter()
        scores, metrics, _ = self.fn(batch.data_source, batch.responses, batch.ground_truth, batch.extra_info)
        batch.scores = torch.tensor(scores, dtype=torch.float32)
        if batch.baseline_responses:  # ReMax: the greedy answers, scored alike
            baseline, _, _ = self.fn(batch.data_source, batch.baseline_responses, batch.ground_truth, batch.extra_info)
            batch.baseline_scores = torch.tensor(baseline, dtype=torch.float32)
            metrics["reward/greedy_baseline/mean"] = float(batch.baseline_scores.mean())
        batch.metrics.update(metrics)
        batch.timing["reward"] = time.perf_counter() - start
        return batch
