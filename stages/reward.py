"""The reward stage: rule functions and, optionally, a reward model scoring decoded responses.

Verb: `score(batch) -> batch` filling `scores` [N] and `reward/*` metrics. A score is
`rule + reward.model_weight x model(prompt + response)`; a part that is off (`reward.function=none`,
no `reward.model` or a weight of 0) is not computed, and each part computed is logged as
`reward/rule/mean`, `reward/model/mean` (`critic/score/*` is the mix). A failing user function scores 0 and is counted
(`reward/errors`) unless `reward.on_error=raise`. A multi-turn episode's environment rewards
(`rollout.env`) are added to that sum, where `reward.function`, if set, scores the last turn.
"""

from __future__ import annotations

import time

import torch

from rlflow.engine.batch import Batch
from rlflow.engine.config import NO_RULE, Config
from rlflow.engine.data.reward_model import RewardModel
from rlflow.engine.data.rewards import RewardFunction
from rlflow.engine.train import memory


class Reward:
    def __init__(self, cfg: Config, device: str = "cpu") -> None:
        rw = cfg.reward
        self.model_weight = rw.model_weight if rw.model else 0.0
        # no rule: none named, or an environment's rewards and no function (the built-ins do not read episodes)
        rule = rw.function != NO_RULE and not (cfg.rollout.env and not rw.function)
        self.fn = RewardFunction(rw.function, rw.on_error, rw.timeout_s) if rule else None
        self.model = (RewardModel(rw.model, cfg.model.dtype, device, memory.forward_tokens(cfg))
                      if self.model_weight else None)

    def score(self, batch: Batch) -> Batch:
        start = time.perf_counter()
        batch.scores, metrics = self.mix(batch, batch.responses)
        if batch.env_rewards.numel():  # a multi-turn episode's environment rewards: the function adds to them
            env = batch.env_rewards.sum(-1)  # [N]
            batch.scores = batch.scores + env
            metrics["reward/env/mean"] = float(env.mean())
        batch.metrics.update(metrics)
        batch.timing["reward"] = time.perf_counter() - start
        return batch

    def mix(self, batch: Batch, responses: list[str]) -> tuple[torch.Tensor, dict[str, float]]:
        """The weighted sum of the rule and model scores of `responses` [N], and their metrics."""
        total = torch.zeros(len(responses))  # [N]
        metrics: dict[str, float] = {}
        if self.fn is not None:
            rule, metrics, _ = self.fn(batch.data_source, responses, batch.ground_truth, batch.extra_info)
            part = torch.tensor(rule, dtype=torch.float32)
            total += part
            metrics["reward/rule/mean"] = float(part.mean())
        if self.model is not None:
            part = self.model.score([p + r for p, r in zip(batch.prompt_text, responses)])
            total += self.model_weight * part
            metrics["reward/model/mean"] = float(part.mean())
        return total, metrics
