"""The critic stage: PPO's value model, the policy's backbone with a one-output head, fitted to GAE returns.

Verbs: `values(batch) -> batch` fills `values` [N, R]; `update(batch) -> batch` regresses them on
`returns` with the clipped value loss and adds the `critic/*` metrics and the `update_critic`
timing to the batch, which the actor's update then reports; `save(dir)`, `load(dir)`.

The model is transformers' token-classification class with one label, loaded from the policy's HF
directory: the backbone's weights come from the policy, the head starts fresh. It trains through
the same TrainEngine as the actor, with its own optimizer and `critic.lr`; batch sizes, epochs,
token budgets, grad clip, weight decay and lr schedule are the actor's.

Invariants:
- `values[:, t]` is read at the position that predicts response token t (the state before it),
  the alignment of the actor's logprobs, and is 0 on padding;
- the head is initialised from `trainer.seed`, so data-parallel replicas start equal; it reads the
  final hidden state without dropout, so values are deterministic and equal the model's eval-mode output;
- losses divide by all-rank token counts: micro-batching and ranks do not change the update;
- rank 0 writes `critic.safetensors` and `critic_trainer.pt` next to the actor's checkpoint files.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForTokenClassification

from engine import algos
from engine.batch import Batch
from engine.config import Config
from engine.train import TrainEngine, all_reduce_sum, micro_batches, response_hidden


def forward_values(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, width: int,
                   pack: bool) -> torch.Tensor:
    """Values [n, R] (R = `width`) in float32 on the model's device, 0 where the response is padding.
    ids/mask/positions: [n, P+R]."""
    device = next(model.parameters()).device
    ids, mask, positions = (x.to(device) for x in (ids, mask, positions))
    valid = mask[:, -width:].bool()  # [n, R]
    hidden = response_hidden(model, ids, mask, positions, valid, pack)  # [M, H]
    values = model.score(hidden).squeeze(-1).float()  # [M]; `score` is the head of Qwen2/Llama-family classes
    return torch.zeros(valid.shape, device=device).masked_scatter(valid, values)


class Critic:
    def __init__(self, cfg: Config, model_path: str, rank: int = 0, world: int = 1, device: str = "cpu") -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        a = cfg.actor
        steps = cfg.trainer.total_steps * a.ppo_epochs * (cfg.data.prompts_per_step // a.mini_batch_prompts)
        with torch.random.fork_rng(devices=[]):  # the fresh head: the same on every rank and in every run
            torch.manual_seed(cfg.trainer.seed)
            self.engine = TrainEngine(model_path, cfg.critic.lr, a.weight_decay, a.grad_clip, a.warmup_steps, steps,
                                      a.lr_schedule, cfg.model.dtype, device,
                                      model_cls=AutoModelForTokenClassification, num_labels=1)

    def values(self, batch: Batch) -> Batch:
        """V(prompt + response[:t]) for every response token t, without gradients."""
        start = time.perf_counter()
        a = self.cfg.actor
        ids, mask, pos = batch.sequences()
        batch.values = torch.zeros(batch.response_ids.shape)  # [N, R]
        with torch.no_grad():
            for rows in micro_batches(mask, a.micro_batch_tokens_per_gpu, a.pack_sequences):
                batch.values[rows] = forward_values(self.engine.model, ids[rows], mask[rows], pos[rows],
                                                    batch.response_ids.shape[1], a.pack_sequences).cpu()
        batch.timing["values"] = time.perf_counter() - start
        return batch

    def update(self, batch: Batch) -> Batch:
        """Clipped value regression on `returns`, ppo_epochs x mini-batches as the actor does."""
        start = time.perf_counter()
        a, mask = self.cfg.actor, batch.response_mask
        rows = a.mini_batch_prompts // self.world * batch.group_size
        stats: dict[str, list[float]] = {}
        for _ in range(a.ppo_epochs):
            for lo in range(0, len(batch), rows):
                out = self.engine.step(partial(self._micro_losses, batch.rows(slice(lo, lo + rows)), stats))
                stats.setdefault("critic/grad_norm", []).append(out["grad_norm"])
                stats.setdefault("critic/lr", []).append(out["lr"])
                stats.setdefault("critic/vf_loss", []).append(all_reduce_sum(out["loss"]))
        batch.metrics.update({k: float(np.mean(v)) for k, v in stats.items()})
        batch.metrics["critic/values/mean"] = float(algos.masked_mean(batch.values, mask))
        batch.metrics["critic/returns/mean"] = float(algos.masked_mean(batch.returns, mask))
        batch.metrics["critic/vf_explained_var"] = float(algos.explained_variance(batch.values, batch.returns, mask))
        batch.timing["update_critic"] = time.perf_counter() - start
        return batch

    def _micro_losses(self, mini: Batch, stats: dict[str, list[float]]) -> list:
        a = self.cfg.actor
        denom = all_reduce_sum(float(mini.response_mask.sum()))
        ids, attn, pos = mini.sequences()
        return [partial(self._loss, mini, r, ids, attn, pos, denom, stats)
                for r in micro_batches(attn, a.micro_batch_tokens_per_gpu, a.pack_sequences)]

    def _loss(self, mini: Batch, r: torch.Tensor, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor,
              denom: float, stats: dict[str, list[float]]) -> torch.Tensor:
        mask = mini.response_mask[r]
        values = forward_values(self.engine.model, ids[r], attn[r], pos[r], mask.shape[1],
                                self.cfg.actor.pack_sequences).cpu()
        loss, m = algos.value_loss(values, mini.values[r], mini.returns[r], mask, self.cfg.critic.cliprange_value,
                                   "token-mean", denom)
        stats.setdefault("critic/vf_clipfrac", []).append(float(m["vf_clipfrac"]))
        return loss

    def save(self, directory: str) -> None:
        """Rank 0 writes the weights and optimizer state into the checkpoint's temp dir; ranks are replicas."""
        if self.rank == 0:
            d = Path(directory)
            state = {k: v.detach().cpu().contiguous() for k, v in self.engine.model.state_dict().items()}
            save_file(state, d / "critic.safetensors", metadata={"format": "pt"})
            torch.save(self.engine.state_dict(), d / "critic_trainer.pt")

    def load(self, directory: str) -> None:
        d = Path(directory)
        self.engine.model.load_state_dict(load_file(d / "critic.safetensors"))
        self.engine.load_state_dict(torch.load(d / "critic_trainer.pt", weights_only=True))
