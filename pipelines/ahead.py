"""Generating ahead of training (`trainer.max_staleness` = k > 0): the rollout pool keeps the next
k steps' batches generating while the trainer updates on this one's, takes the trainer's weights
beside them, and is replaced, while training goes on, if a rollout worker dies or hangs.

The pool generates each batch from the newest weights it holds when it starts it, and step s's is
queued at step s - k, after version s - k was pushed: no batch is trained on by weights more than
k versions newer than its own. The loader moves past a batch only when its step takes it (the ones
ahead are peeked), so a checkpoint's loader position is a synchronous run's, and a resumed run
generates the batches that were in flight again, from the checkpoint's weights, skipping no prompt.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import ray

from rlflow.engine.batch import Update
from rlflow.engine.config import Config
from rlflow.engine.data.prompts import PromptLoader
from rlflow.pipelines import hangs
from rlflow.pipelines.runtime import (
    SUBMIT,
    WORKER_LOST,
    Stages,
    how_lost,
    rebuild_rollout,
    rollout_lost,
    settle,
    submit_rollout,
    wait,
)
from rlflow.stages.reward import Reward


class Ahead:
    def __init__(self, cfg: Config, model_path: str, tracker: Any = None) -> None:
        """`tracker`: the run's, which keeps a lost pool's hang report (`hang/rollout_<n>`)."""
        self.cfg, self.model_path, self.k, self.tracker = cfg, model_path, cfg.trainer.max_staleness, tracker
        self.queued: deque[list[Any]] = deque()  # batches generating (refs, one per rank), a step's each
        self.rebuilds = 0  # rollout pools replaced while training went on

    def reset(self) -> None:
        """Fresh workers: what was generating went with the old ones."""
        self.queued.clear()

    def batches(self, stages: Stages, loader: PromptLoader, step: int) -> list[Any]:
        """This step's scored batches, once generated, with the next k steps' queued behind them."""
        assert stages.reward is not None
        while True:
            self._queue(stages, loader, step)
            try:
                generated = wait(self.queued[0], SUBMIT)
                break
            except WORKER_LOST as e:  # a rollout worker died, or was stopped as stuck by the watchdog
                self._rebuild(stages, e, [r for refs in self.queued for r in refs])
        self.queued.popleft()
        loader.next_batch()
        score = stages.reward.bound(SUBMIT)
        return wait([score.at(r, Reward.score, b) for r, b in enumerate(generated)], SUBMIT)

    def push(self, stages: Stages, outputs: list[Update]) -> None:
        """The rollout pool receives this step's weights beside the generation queued on it
        (runtime.Broadcast), and takes them as it starts its next batch."""
        push = stages.sync.bound(SUBMIT).after_update(outputs)
        try:
            wait(push, SUBMIT)
        except (*WORKER_LOST, ray.exceptions.RayTaskError) as e:  # a push to a dead rank fails on the trainer
            self._rebuild(stages, e, push + [r for refs in self.queued for r in refs])

    def _queue(self, stages: Stages, loader: PromptLoader, step: int) -> None:
        """Submit the generation of this step's batch and the next k, those not queued yet."""
        assert stages.generator is not None
        while len(self.queued) <= self.k and step + len(self.queued) < self.cfg.trainer.total_steps:
            # generation only: a score queued now on a worker the trainer shares would hold up its
            # update (an actor runs its calls in order) until the batch exists
            ahead = len(self.queued)
            self.queued.append(submit_rollout(stages.generator, None, loader.peek_batch(ahead), step + ahead))

    def _rebuild(self, stages: Stages, e: Exception, lost: list[Any]) -> None:
        """A rollout worker that died or hangs is replaced while the trainer goes on: a new pool takes
        the trainer's current weights and generates the queued steps again. Any other loss, or more
        than `trainer.max_restarts` of these, goes to the driver (`e` raised), which rebuilds every
        worker from the last checkpoint. `lost`: the calls given up on. A rollout worker stuck in a
        call is found by the driver's watchdog (pipelines/hangs.py), which explains and kills it:
        it is lost as a dead one is."""
        limit = self.cfg.trainer.max_restarts
        if self.rebuilds >= limit or not rollout_lost(stages):
            raise e
        self.rebuilds += 1
        why = hangs.lost(how_lost(e), [p for p in stages.pools if p.name == "rollout"],
                         stages.groups(), Path(self.cfg.trainer.output_dir) / "hang" / f"rollout_{self.rebuilds}",
                         self.tracker)
        print(f"rlflow: a rollout worker {why} ({type(e).__name__})")
        print(f"rlflow: new rollout pool {self.rebuilds}/{limit}, training goes on")
        self.queued.clear()
        rebuild_rollout(self.cfg, self.model_path, stages)
        settle(lost)  # the old pool is gone: its calls have failed by now
