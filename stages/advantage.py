"""The advantage stage: engine.algos' estimators on a scored batch, and the KL controller's state.

Verbs: `estimate(batch, baseline) -> batch` fills `advantages` [N, R] (and, for GAE, the critic's
`returns`; for ReMax, `baseline` holds the scored greedy answer of each prompt, a second generate
request of the pipeline, unless the batch already carries their scores); `save(dir)` and
`load(dir)` keep the adaptive KL coefficient across a resume. It runs in the policy's process,
between the critic's values and the updates.

`algorithm.advantage` picks the estimator (`engine.algos.ESTIMATORS`, or one of the user's own):
a group baseline (GRPO, Dr.GRPO, RLOO, REINFORCE++), ReMax's greedy-answer baseline, or GAE over
the critic's values (PPO). The estimators that read per-token rewards (REINFORCE++ and GAE) see a
multi-turn episode's rewards on the turns that earned them; the others, the episode's total. With
`algorithm.kl_coef` > 0 a per-token KL penalty to the reference (k1) joins the rewards, its
coefficient fixed or adapted to `algorithm.kl_target` after every step that trains the policy.
DAPO's overlong shaping changes the reward the advantages see; the logged score stays raw.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rlflow.engine import algos
from rlflow.engine.batch import Batch
from rlflow.engine.config import Config, estimator_of


class Advantage:
    def __init__(self, cfg: Config, rank: int = 0) -> None:
        self.cfg, self.rank = cfg, rank
        alg = cfg.algorithm
        self.estimator = estimator_of(alg.advantage)
        self.kl_ctl = (algos.AdaptiveKLController(alg.kl_coef, alg.kl_target, algos.KL_HORIZON)
                       if alg.kl_target > 0 else algos.FixedKLController(alg.kl_coef))

    def estimate(self, batch: Batch, baseline: Batch | None = None) -> Batch:
        start = time.perf_counter()
        alg, mask, rw = self.cfg.algorithm, batch.loss_mask, self.cfg.reward
        if baseline is not None:  # ReMax: one greedy answer a prompt, scored; its generation's time counts
            batch.baseline_scores = baseline.scores.repeat_interleave(batch.group_size)  # [N]
            batch.timing["baseline"] = sum(baseline.timing.values())
        scores = batch.scores
        if rw.overlong_buffer:  # DAPO: shape the reward that advantages see; the logged score stays raw
            penalty = algos.overlong_penalty(mask.sum(1), self.cfg.rollout.max_new_tokens, rw.overlong_buffer)
            scores = scores + penalty
            batch.metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
        # per-token rewards, for the estimators that read them: an episode's turns keep theirs
        earned = batch.env_rewards if batch.env_rewards.numel() else None
        rewards = algos.token_scores(scores, mask, earned)  # [N, R]
        if alg.kl_coef:
            kl = algos.kl_penalty(batch.old_logprobs, batch.ref_logprobs, algos.REWARD_KL)
            rewards = algos.kl_in_reward(rewards, kl, mask, self.kl_ctl.value)
            batch.metrics["actor/reward_kl_penalty"] = float(algos.masked_mean(kl, mask))
            batch.metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctl.value
            if batch.step >= self.cfg.critic.warmup_steps:  # a step that trains the policy moves the coefficient
                self.kl_ctl.update(batch.metrics["actor/reward_kl_penalty"], len(batch))
        greedy = batch.baseline_scores if self.estimator.greedy_baseline else None
        if greedy is not None:
            batch.metrics["reward/greedy_baseline/mean"] = float(greedy.mean())
        batch.advantages, returns = self.estimator.compute(algos.AdvantageInputs(
            scores, mask, batch.group_size, rewards, alg.gamma, alg.lam, greedy,
            batch.values if self.estimator.critic else None))
        if returns is not None:  # a critic's targets
            batch.returns = returns
        batch.timing["adv"] = time.perf_counter() - start
        return batch

    def save(self, directory: str) -> None:
        torch.save({"kl": self.kl_ctl.value}, Path(directory) / f"advantage_{self.rank}.pt")

    def load(self, directory: str) -> None:
        own = Path(directory) / f"advantage_{self.rank}.pt"
        older = Path(directory) / f"worker_{self.rank}.pt"  # checkpoints before this stage kept it there
        if own.exists():
            self.kl_ctl.value = torch.load(own, weights_only=True)["kl"]
        elif older.exists():
            self.kl_ctl.value = torch.load(older, weights_only=True).get("kl", self.kl_ctl.value)
