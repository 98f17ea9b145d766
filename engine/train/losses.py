"""The policy's losses: one object per algorithm, which `stages.policy.Policy.update` trains with.

A loss turns one rank's batch into optimizer steps on a `TrainEngine` (mini-batches, micro-batch
losses) and returns the step's metrics; `evaluate` (where it has one) gives the same metrics of
the current weights without a step:
- `PolicyGradient`: PPO-clip epochs over mini-batches of whole prompt groups, with
  `actor.policy_loss` choosing the per-token objective (PPO's clip, GSPO's sequence ratio,
  CISPO's clipped IS weight; the formulas are engine.algos.policy_loss), plus the entropy and
  KL-to-reference terms (GRPO, its relatives and PPO);
- `Supervised`: one step of next-token cross-entropy on the response tokens (SFT, the warm start);
- `Preference`: DPO steps over chosen/rejected pair rows carrying the reference's logprobs.

Invariants:
- losses divide by all-rank token/sequence/pair counts, so an update does not depend on how rows
  are split into micro-batches or ranks; every rank returns the same all-rank metrics, except
  `PolicyGradient`'s per-rank means, which the driver averages;
- with `actor.sp` > 1 each SP group gathers its members' rows and every member trains on all of
  them, on its slice of each row's tokens (engine/train/ulysses.py); per-micro-batch metrics are
  made the group's, so numbers match sp=1.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from rlflow.engine import algos
from rlflow.engine.batch import Batch
from rlflow.engine.config import Config, packed
from rlflow.engine.tensors import to_device
from rlflow.engine.train.batching import micro_batches
from rlflow.engine.train.fsdp import (
    ResponseLM,
    TrainEngine,
    all_reduce_sum,
    all_reduce_sums,
    forward_logprobs,
    in_step,
    step_metrics,
)


class Loss(Protocol):
    max_staleness: int | None  # how many weight versions older than the policy a batch may be (None: any)

    def update(self, trainer: TrainEngine, batch: Batch) -> dict[str, float]:
        """Optimizer steps on `batch` (this rank's rows), collective over the ranks; the step's metrics."""
        ...


class Evaluated(Loss, Protocol):
    def evaluate(self, trainer: TrainEngine, batch: Batch) -> dict[str, float]:
        """`update`'s loss metrics of the current weights, without a step; collective too."""
        ...


def budget(configured: int, trainer: TrainEngine) -> int:
    """A micro-batch's token budget: the configured one, or on auto the trainer's plan."""
    return configured if configured > 0 else trainer.micro_tokens


def no_step(root: ResponseLM, losses: Callable[[torch.Tensor], torch.Tensor], micro: list[torch.Tensor]) -> float:
    """The sum of `losses(rows)` over the micro-batches' rows, without gradients; as many forwards
    as every other rank runs."""
    total, count = 0.0, in_step(root, len(micro))  # a collective: before any forward
    with torch.no_grad():
        for rows in micro:
            total += float(losses(rows))
        for _ in range(count - len(micro)):
            root.idle()
    return total


def sp_members(root: ResponseLM, batch: Batch) -> tuple[list[Batch], int]:
    """The batches of this rank's SP group in rank order (just `batch` without sequence
    parallelism) and this rank's index among them: the group trains on all their rows."""
    group = root.sp_group
    if group is None:
        return [batch], 0
    members: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(members, batch, group=group)
    return members, dist.get_rank(group)


class PolicyGradient:
    """PPO-clip epochs over mini-batches of `actor.mini_batch_prompts` prompts (over all ranks)."""

    def __init__(self, cfg: Config) -> None:
        self.max_staleness: int | None = cfg.trainer.max_staleness  # generation may run this many versions ahead
        self.actor, self.workers, self.pack = cfg.actor, cfg.placement.workers, packed(cfg)
        self.temperature, self.max_new_tokens = cfg.rollout.temperature, cfg.rollout.max_new_tokens
        self.warmup = cfg.critic.warmup_steps
        self.correction, self.cap = cfg.algorithm.rollout_correction, cfg.algorithm.rollout_correction_cap

    def update(self, trainer: TrainEngine, batch: Batch) -> dict[str, float]:
        """No step, and no metrics, while the critic warms up (its first `critic.warmup_steps` steps)."""
        if batch.step < self.warmup:
            return {}
        a = self.actor
        rows = a.mini_batch_prompts // self.workers * batch.group_size
        stats: dict[str, list] = {}  # floats and 0-dim device tensors
        members, _ = sp_members(trainer.root, batch)
        for _ in range(a.ppo_epochs):
            for lo in range(0, len(batch), rows):
                # an SP group's mini-batch: each member's rows of it (members hold equally many)
                mini = batch.rows(slice(lo, lo + rows)) if len(members) == 1 else \
                    Batch.cat([m.rows(slice(lo, lo + rows)) for m in members])
                ids, attn, pos = mini.sequences()
                # the response tokens this rank's loss covers: all, or with SP its slice's; so the
                # all-rank token count below counts each token once (a row once: sp ranks hold it)
                mask = mini.loss_mask * trainer.root.response_mask(attn, mini.response_ids.shape[1])
                denom = all_reduce_sum(float(len(mini)) / a.sp if algos.divides_by_rows(a.loss_agg)
                                       else float(mask.sum()))
                prompt_width = attn.shape[1] - mini.response_ids.shape[1] if a.share_prompts else 0
                micro = micro_batches(attn, budget(a.micro_batch_tokens_per_gpu, trainer), self.pack,
                                      mini.group_size, prompt_width)
                with trainer.step(len(micro)) as step:
                    for r in micro:
                        step.backward(self._loss(trainer.root, mini, r, ids, attn, pos, mask, denom, stats))
                for k in ("grad_norm", "lr"):
                    stats.setdefault(f"actor/{k}", []).append(step.out[k])
                stats.setdefault("actor/pg_loss", []).append(all_reduce_sum(step.out["loss"]))
        return step_metrics(stats)

    def _loss(self, root: ResponseLM, mini: Batch, r: torch.Tensor, ids, attn, pos, owned: torch.Tensor, denom: float,
              stats) -> torch.Tensor:
        """One micro-batch's loss over this rank's `owned` response tokens, computed on the model's
        device. Its metrics stay device tensors until the step ends: reading one here would hold
        the host until the forward is done, before it could queue the backward."""
        a = self.actor
        logp, entropy = forward_logprobs(root, ids[r], attn[r], pos[r], mini.response_ids[r],
                                         self.temperature, self.pack, share=a.share_prompts)
        on = lambda x: to_device(x[r], logp.device)  # noqa: E731
        mask = on(owned)
        means: dict[str, torch.Tensor] = {}  # masked means over this rank's tokens; with SP, the group's below
        if mini.old_logprobs.numel():
            old = on(mini.old_logprobs)
        else:  # on-policy: these weights generated the batch (see Policy.logprobs)
            old = logp.detach()
            diff = (old.exp() - on(mini.rollout_logprobs).exp()).abs() * mask
            means["training/rollout_probs_diff_mean"] = algos.masked_mean(diff, mask)
            stats.setdefault("training/rollout_probs_diff_max", []).append(_group_max(root, diff.max()))
        weights = None
        if self.correction != algos.NO_CORRECTION:
            if not mini.rollout_logprobs.numel():
                raise RuntimeError("algorithm.rollout_correction needs the rollout engine's logprobs; "
                                   "this batch has none")
            weights, c = algos.rollout_correction(old, on(mini.rollout_logprobs), mask, self.correction, self.cap)
            stats.setdefault("rollout_correction/weight_max", []).append(_group_max(root, c.pop("weight_max")))
            means.update({f"rollout_correction/{k}": v for k, v in c.items()})
        norm_len = self.max_new_tokens
        loss, m = algos.policy_loss(logp, old, on(mini.advantages), mask, a.clip_low, a.clip_high,
                                    a.dual_clip or None, a.loss_agg, denom, norm_len, a.policy_loss, weights)
        means["actor/entropy"] = algos.masked_mean(entropy.detach(), mask)
        if a.entropy_coef:
            loss = loss - a.entropy_coef * algos.agg_loss(entropy, mask, a.loss_agg, denom, norm_len)
        if mini.ref_logprobs.numel():  # a reference stage ran
            kl = algos.kl_penalty(logp, on(mini.ref_logprobs), a.kl_loss_type)
            means["actor/kl_loss"] = algos.masked_mean(kl.detach(), mask)
            if a.kl_loss_coef:
                loss = loss + a.kl_loss_coef * algos.agg_loss(kl, mask, a.loss_agg, denom, norm_len)
        means.update({f"actor/{k}": v for k, v in m.items()})  # masked means too (algos.policy_loss)
        for k, v in _group_means(root, means, mask.sum()).items():
            stats.setdefault(k, []).append(v)
        return loss


def _group_means(root: ResponseLM, means: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masked means over this rank's `tokens` -> the same means over the SP group's tokens
    (the whole rows, as without SP). 0-dim device tensors in and out."""
    group = root.sp_group
    if group is None:
        return means
    t = torch.stack([v.double() * tokens for v in means.values()] + [tokens.double()])
    dist.all_reduce(t, group=group)
    return dict(zip(means, t[:-1] / t[-1].clamp(min=1e-8)))


def _group_max(root: ResponseLM, value: torch.Tensor) -> torch.Tensor:
    group = root.sp_group
    if group is None:
        return value
    t = value.detach().float().reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t[0]


class Supervised:
    """One optimizer step of next-token cross-entropy on the response tokens only, a mean over
    every rank's response tokens (`sft/loss`; the optimizer numbers are all ranks')."""

    max_staleness: int | None = None

    def __init__(self, cfg: Config) -> None:
        self.budget, self.pack = cfg.actor.micro_batch_tokens_per_gpu, packed(cfg)

    def update(self, trainer: TrainEngine, batch: Batch) -> dict[str, float]:
        loss, micro = self._losses(trainer, batch)
        with trainer.step(len(micro)) as step:
            for rows in micro:
                step.backward(loss(rows))
        out = step.out
        return {"sft/loss": all_reduce_sum(out["loss"]), "sft/grad_norm": out["grad_norm"], "sft/lr": out["lr"]}

    def evaluate(self, trainer: TrainEngine, batch: Batch) -> dict[str, float]:
        return {"sft/loss": all_reduce_sum(no_step(trainer.root, *self._losses(trainer, batch)))}

    def _losses(self, trainer: TrainEngine, batch: Batch) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                                                    list[torch.Tensor]]:
        """(a micro-batch's loss from its rows, the micro-batches' rows)."""
        root = trainer.root
        ids, attn, pos = batch.sequences()
        denom = all_reduce_sum(float(batch.loss_mask.sum()))

        def loss(r: torch.Tensor) -> torch.Tensor:
            logp, _ = forward_logprobs(root, ids[r], attn[r], pos[r], batch.response_ids[r], 1.0, self.pack,
                                       entropy=False)
            return -(logp * batch.loss_mask[r].to(logp.device)).sum() / denom

        return loss, micro_batches(attn, budget(self.budget, trainer), self.pack)


DPO_NAMES = {"rewards/chosen": "chosen_reward", "rewards/rejected": "rejected_reward",
             "rewards/margin": "reward_margin", "rewards/accuracy": "reward_accuracy", "nll": "nll"}


class Preference:
    """DPO optimizer steps over pair rows (chosen then rejected, group_size 2) that carry the
    reference's logprobs, `actor.mini_batch_prompts` pairs (over all ranks) per step. Metrics
    (`dpo/loss`, `dpo/reward_margin`, ...) are means over every rank's pairs, measured in each
    mini-batch's forward, before its step."""

    max_staleness: int | None = None

    def __init__(self, cfg: Config) -> None:
        self.beta, self.nll_coef, self.workers = cfg.dpo.beta, cfg.dpo.nll_coef, cfg.placement.workers
        self.pairs_per_step = cfg.actor.mini_batch_prompts
        self.budget, self.pack = cfg.actor.micro_batch_tokens_per_gpu, packed(cfg)

    def update(self, trainer: TrainEngine, batch: Batch) -> dict[str, float]:
        rows = 2 * (self.pairs_per_step // self.workers)
        sums: dict[str, float] = {}
        outs = []
        for lo in range(0, len(batch), rows):
            loss, micro = self._losses(trainer, batch.rows(slice(lo, lo + rows)), sums)
            with trainer.step(len(micro)) as step:
                for r in micro:
                    step.backward(loss(r))
            outs.append(step.out)
        return {**self._means(sums, len(batch) // 2), "dpo/grad_norm": float(np.mean([o["grad_norm"] for o in outs])),
                "dpo/lr": outs[-1]["lr"]}

    def evaluate(self, trainer: TrainEngine, batch: Batch) -> dict[str, float]:
        sums: dict[str, float] = {}
        no_step(trainer.root, *self._losses(trainer, batch, sums))
        return self._means(sums, len(batch) // 2)

    def _means(self, sums: dict[str, float], pairs: int) -> dict[str, float]:
        """Per-pair statistics summed over this rank's `pairs` -> means over every rank's pairs."""
        *totals, every = all_reduce_sums([*sums.values(), float(pairs)])
        return {f"dpo/{k}": v / every for k, v in zip(sums, totals)}

    def _losses(self, trainer: TrainEngine, mini: Batch, sums: dict[str, float]
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
        """(a micro-batch's loss from its rows, the micro-batches' rows: whole pairs)."""
        ids, attn, pos = mini.sequences()  # [2b, L]
        pairs = len(mini) // 2
        denom = all_reduce_sum(float(pairs))  # the loss is a mean over every rank's pairs
        # micro-batches of whole pairs: a pair's two rows side by side make one [b, 2L] row
        chunks = micro_batches(attn.reshape(pairs, -1), budget(self.budget, trainer), self.pack)
        return (partial(self._loss, trainer.root, mini, ids=ids, attn=attn, pos=pos, denom=denom, sums=sums),
                [torch.stack([2 * c, 2 * c + 1], 1).flatten() for c in chunks])

    def _loss(self, root: ResponseLM, mini: Batch, r: torch.Tensor, ids, attn, pos, denom: float,
              sums: dict[str, float]) -> torch.Tensor:
        # DPO compares the models' own distributions: temperature 1, as the reference scores them
        logp, _ = forward_logprobs(root, ids[r], attn[r], pos[r], mini.response_ids[r], 1.0, self.pack, entropy=False)
        mask = mini.loss_mask[r].to(logp.device)
        seq = (logp * mask).sum(1).view(-1, 2)  # [b, 2]: chosen, rejected
        ref_seq = (mini.ref_logprobs[r].to(logp.device) * mask).sum(1).view(-1, 2)
        loss, m = algos.dpo_loss(seq[:, 0], seq[:, 1], ref_seq[:, 0], ref_seq[:, 1], self.beta,
                                 mask.sum(1).view(-1, 2)[:, 0], self.nll_coef)
        b = len(seq)
        for key, value in {"loss": loss.detach(), **{DPO_NAMES[k]: v for k, v in m.items()}}.items():
            sums[key] = sums.get(key, 0.0) + float(value) * b
        return loss * b / denom
