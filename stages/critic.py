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
- rank 0 writes `critic.safetensors`, every rank its optimizer shards into `critic_trainer/`,
  next to the actor's checkpoint files; like the actor's, FSDP2 shards the critic over the ranks.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForTokenClassification

from rlflow.engine import algos
from rlflow.engine.batch import Batch
from rlflow.engine.config import Config, longest_row, packed
from rlflow.engine.tensors import to_device
from rlflow.engine.train import memory
from rlflow.engine.train.batching import micro_batches
from rlflow.engine.train.fsdp import (
    TrainEngine,
    all_reduce_sum,
    in_step,
    response_hidden,
    scatter_valid,
    step_metrics,
)


class ValueModel(nn.Module):
    """The token-classification model behind one forward returning the values [M] at the M valid
    response positions: the critic's FSDP2 root (see engine.train.fsdp.TrainEngine)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                pack: bool) -> torch.Tensor:
        hidden = response_hidden(self.model, ids, mask, positions, valid, pack)  # [M, H]
        # `score`: the head of Qwen2/Llama-family classes; a fresh tensor, as FSDP2 wants of its outputs
        return self.model.score(hidden).squeeze(-1).float().clone()

    def idle(self) -> torch.Tensor:
        """A one-token forward with loss 0, for a rank with fewer micro-batches than the others."""
        device = next(self.parameters()).device
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        return self(ids, torch.ones_like(ids), torch.arange(2, device=device)[None],
                    torch.ones(1, 1, dtype=torch.bool, device=device), False).sum() * 0.0


def forward_values(root: ValueModel, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, width: int,
                   pack: bool) -> torch.Tensor:
    """Values [n, R] (R = `width`) in float32 on the model's device, 0 where the response is padding.
    ids/mask/positions: [n, P+R], on one device, best the host's (see `response_hidden`)."""
    valid = mask[:, -width:].bool()  # [n, R]
    return scatter_valid(valid, root(ids, mask, positions, valid, pack))


HEAD = "score."  # the token-classification head's parameters, absent from the policy's directory
ROW = re.compile(r"^(\S+)\s+\|", re.M)  # a row of transformers' load report: "key | status | ..."


class _HeadOnly(logging.Filter):
    """Drops transformers' load report where every key it names is the head's: the report is a
    warning, and a head the critic starts fresh is by design. Any other key keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        keys = [k for k in ROW.findall(message) if k != "Key"]
        return "LOAD REPORT" not in message or not keys or not all(k.startswith(HEAD) for k in keys)


@contextmanager
def fresh_head_unreported() -> Iterator[None]:
    logger, quiet = logging.getLogger("transformers.modeling_utils"), _HeadOnly()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class Critic:
    def __init__(self, cfg: Config, model_path: str, rank: int = 0, world: int = 1, device: str = "cpu") -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        a = cfg.actor
        steps = cfg.trainer.total_steps * a.ppo_epochs * (cfg.data.prompts_per_step // a.mini_batch_prompts)
        with torch.random.fork_rng(devices=[]), fresh_head_unreported():  # the fresh head: the same on
            torch.manual_seed(cfg.trainer.seed)  # every rank and in every run
            self.engine = TrainEngine(model_path, cfg.critic.lr, a.weight_decay, a.grad_clip, a.warmup_steps, steps,
                                      a.lr_schedule, cfg.model.dtype, device, root=ValueModel,
                                      **memory.settings(cfg), compile_layers=a.compile_layers,
                                      model_cls=AutoModelForTokenClassification, num_labels=1)

    def values(self, batch: Batch) -> Batch:
        """V(prompt + response[:t]) for every response token t, without gradients."""
        start = time.perf_counter()
        pack = packed(self.cfg)
        ids, mask, pos = batch.sequences()
        batch.values = torch.zeros(batch.response_ids.shape)  # [N, R]
        chunks = micro_batches(mask, self.engine.fit(longest_row(self.cfg)).tokens, pack)
        with torch.no_grad():
            for rows in chunks:
                batch.values[rows] = forward_values(self.engine.root, ids[rows], mask[rows], pos[rows],
                                                    batch.response_ids.shape[1], pack).cpu()
            for _ in range(in_step(self.engine.root, len(chunks)) - len(chunks)):
                self.engine.root.idle()
        batch.timing["values"] = time.perf_counter() - start
        return batch

    def update(self, batch: Batch) -> Batch:
        """Clipped value regression on `returns`, ppo_epochs x mini-batches as the actor does."""
        start = time.perf_counter()
        a, mask = self.cfg.actor, batch.loss_mask
        rows = a.mini_batch_prompts // self.world * batch.group_size
        stats: dict[str, list] = {}  # floats and 0-dim device tensors (see the actor's `_loss`)
        for _ in range(a.ppo_epochs):
            for lo in range(0, len(batch), rows):
                mini = batch.rows(slice(lo, lo + rows))
                denom = all_reduce_sum(float(mini.loss_mask.sum()))
                ids, attn, pos = mini.sequences()
                micro = micro_batches(attn, self.engine.fit(longest_row(self.cfg)).tokens, packed(self.cfg))
                with self.engine.step(len(micro)) as step:
                    for r in micro:
                        step.backward(self._loss(mini, r, ids, attn, pos, denom, stats))
                stats.setdefault("critic/grad_norm", []).append(step.out["grad_norm"])
                stats.setdefault("critic/lr", []).append(step.out["lr"])
                stats.setdefault("critic/vf_loss", []).append(all_reduce_sum(step.out["loss"]))
        batch.metrics.update(step_metrics(stats))
        batch.metrics["critic/values/mean"] = float(algos.masked_mean(batch.values, mask))
        batch.metrics["critic/returns/mean"] = float(algos.masked_mean(batch.returns, mask))
        batch.metrics["critic/vf_explained_var"] = float(algos.explained_variance(batch.values, batch.returns, mask))
        batch.timing["update_critic"] = time.perf_counter() - start
        return batch

    def _loss(self, mini: Batch, r: torch.Tensor, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor,
              denom: float, stats: dict[str, list]) -> torch.Tensor:
        values = forward_values(self.engine.root, ids[r], attn[r], pos[r], mini.response_mask.shape[1],
                                packed(self.cfg))
        on = lambda x: to_device(x[r], values.device)  # noqa: E731
        loss, m = algos.value_loss(values, on(mini.values), on(mini.returns), on(mini.loss_mask),
                                   self.cfg.critic.cliprange_value, "token-mean", denom)
        stats.setdefault("critic/vf_clipfrac", []).append(m["vf_clipfrac"])
        return loss

    def save(self, directory: str) -> None:
        """Every rank: rank 0 writes the full weights, each rank its optimizer shards (torch DCP)."""
        d = Path(directory)
        full = self.engine.full_state_dict()  # collective
        if self.rank == 0:
            save_file(full, d / "critic.safetensors", metadata={"format": "pt"})
        dcp.save(self.engine.state_dict(), checkpoint_id=d / "critic_trainer")

    def load(self, directory: str) -> None:
        d = Path(directory)
        self.engine.load(load_file(d / "critic.safetensors"), d / "critic_trainer")
