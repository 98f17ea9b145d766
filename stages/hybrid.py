"""The policy colocated with its rollout engine in one process: the hybrid engine.

`HybridPolicy` is a `stages.policy.Policy` that also generates (`generate`, with a
`stages.rollout.Rollout` of its own) and owns the memory switch between the two. The trainer
(FSDP2 shards) and the rollout engine (its own layout, on the same device) hold separate copies of
the weights; when the trainer's changed (an update, a load), the next `generate` first has
`engine.reshard` move them into the rollout's in place, after the optimizer state and gradients
made room (so the engine may release its own memory, KV cache and weights, while training).
Its other verbs are the policy's, after giving training its memory back.

Invariants:
- `generate` is collective when the weights changed since the last call (every rank reshards
  together); the pipeline has every rank generate, also one without prompts;
- sampling is seeded from the step (stages/rollout.py): a resumed step draws the same samples.
"""

from __future__ import annotations

import time

import torch

from rlflow.engine.batch import Batch, RolloutRequest, Update
from rlflow.engine.config import Config
from rlflow.engine.reshard import weight_sync
from rlflow.engine.train.losses import Loss
from rlflow.stages.policy import Policy
from rlflow.stages.rollout import Rollout


class HybridPolicy(Policy):
    def __init__(self, cfg: Config, model_path: str, rank: int = 0, world: int = 1, device: str = "cpu") -> None:
        super().__init__(cfg, model_path, rank, world, device)
        self.rollout = Rollout(cfg, model_path, rank, world, device)
        self.sync_rollout = weight_sync(self.engine.model, self.rollout.engine)  # collective: every rank calls it

    def generate(self, request: RolloutRequest) -> Batch:
        start = time.perf_counter()
        reshard = self._to_generation()
        switched = time.perf_counter()
        batch = self.rollout.generate(request)
        batch.timing["gen"] = time.perf_counter() - switched
        batch.timing["switch"] = switched - start - reshard
        batch.timing["reshard"] = reshard
        return batch

    def logprobs(self, batch: Batch) -> Batch:
        self._to_training(batch)
        return super().logprobs(batch)

    def update(self, batch: Batch, loss: Loss) -> Update:
        self._to_training(batch)
        out = super().update(batch, loss)
        out.metrics["perf/reshard_gb_from_peers"] = self.sync_rollout.bytes_from_peers / 1e9
        out.metrics["perf/weight_sync_gb"] = self.sync_rollout.bytes_received / 1e9  # what the engine takes a sync
        return out

    def load(self, directory: str) -> None:
        super().load(directory)
        self.rollout.weight_version = -1  # whatever it holds is not the checkpoint's: sync at the next generate

    def _to_generation(self) -> float:
        """Give generation the memory training holds only between updates: the gradients always
        (the next step starts from zero), the optimizer state and the rollout's memory per config.
        Then the rollout engine takes the trainer's weights if they changed: after that memory
        moved, so the two never peak together. Returns the weight sync's seconds."""
        self.engine.optimizer.zero_grad(set_to_none=True)
        if self.cfg.actor.offload_optimizer:
            self.engine.offload()
        if self.cfg.rollout.free_cache:
            self.rollout.engine.resume_memory()
        if self.rollout.weight_version == self.weight_version:
            return 0.0
        start = time.perf_counter()
        self.sync_rollout()  # collective: every rank generates
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()  # the reshard's copies and collectives are queued work
        self.rollout.weight_version = self.weight_version
        return time.perf_counter() - start

    def _to_training(self, batch: Batch) -> None:
        """Give training back its memory; the time adds to the batch's `switch`."""
        start = time.perf_counter()
        if self.cfg.rollout.free_cache:
            self.rollout.engine.release_memory(weights=True)
            self.rollout.weight_version = -1  # what it holds may be gone: the next generate writes them all
        self.engine.onload()
        batch.timing["switch"] = batch.timing.get("switch", 0.0) + time.perf_counter() - start
