"""The hybrid actor stage: one process that generates with the rollout engine and trains the policy.

Verbs: `generate`, `logprobs`, `advantages`, `update`, `sft_update`, `sft_eval`, `dpo_update`, `dpo_eval`, `save`,
`load`, `export`.
The trainer (FSDP2 shards) and the rollout engine (its own layout, on the same device) hold
separate copies of the weights; after every update `engine.reshard` moves the trainer's into
the rollout's in place. Every verb but `generate` and `advantages` is collective: every rank of
the pool calls it together. With `rollout.tp` > 1, `generate` is collective within each group of
tp consecutive ranks: the group generates all its ranks' prompts together, tensor parallel, and
each rank keeps its own.

Invariants:
- sampling is seeded from (trainer.seed, step, rank): a resumed step draws the same samples;
- a mini-batch holds whole prompt groups; losses divide by all-rank token/sequence counts so the
  update does not depend on how rows are split into micro-batches or ranks;
- `old_logprobs` are recomputed by the trainer; the rollout's own logprobs only feed the
  train/infer mismatch metrics;
- with a critic (`algorithm.advantage=gae`) the policy does not move during the first
  `critic.warmup_steps` RL steps: `update` reports the step without an optimizer step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from engine import algos, checkpoint
from engine.batch import Batch, RolloutRequest
from engine.config import Config
from engine.native_model import TP
from engine.reshard import weight_sync
from engine.rollout import SamplingParams, build_rollout, left_pad
from engine.train import TrainEngine, all_reduce_sum, forward_logprobs, micro_batches, response_logprobs


def right_pad(rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=dtype)
    return out


class ActorRollout:
    def __init__(self, cfg: Config, model_path: str, rank: int = 0, world: int = 1,
                 device: str = "cpu") -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        a = cfg.actor
        rl_steps = cfg.trainer.total_steps - cfg.critic.warmup_steps  # the policy waits while the critic warms up
        self.engine = TrainEngine(model_path, a.lr, a.weight_decay, a.grad_clip, a.warmup_steps,
                                  rl_steps * a.ppo_epochs * (cfg.data.prompts_per_step // a.mini_batch_prompts),
                                  a.lr_schedule, cfg.model.dtype, device, checkpointing=a.activation_checkpointing)
        r = cfg.rollout
        self.tp = TP.over_world(r.tp)  # a TP group generates the prompts of all its ranks at once
        self.rollout = build_rollout(r.backend, self.tokenizer, model_path, r.dtype, device,
                                     cfg.data.max_prompt_tokens + r.max_new_tokens,
                                     -(-cfg.data.prompts_per_step * r.samples_per_prompt // world) * r.tp,
                                     r.kv_cache_memory, self.tp if r.tp > 1 else None)
        self.sync_rollout = weight_sync(self.engine.model, self.rollout)  # collective: every rank calls it
        alg = cfg.algorithm
        self.kl_ctl = (algos.AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon)
                       if alg.kl_target > 0 else algos.FixedKLController(alg.kl_coef))

    # -- rollout ---------------------------------------------------------------------------
    def generate(self, request: RolloutRequest) -> Batch:
        start = time.perf_counter()
        self._to_generation()
        r = self.cfg.rollout
        params = SamplingParams(
            temperature=0.0 if request.greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
            n=1 if request.greedy else request.samples or r.samples_per_prompt, max_new_tokens=r.max_new_tokens,
            stop_strings=r.stop_strings, seed=hash((self.cfg.trainer.seed, request.step, self.rank // r.tp)) % 2**31)
        prompts, mine = self._tp_prompts([p.ids for p in request.prompts])
        groups = self.rollout.generate(prompts, params)[mine]
        baseline = []
        if self.cfg.algorithm.advantage == "remax" and not (request.greedy or request.samples):
            # ReMax's baseline: one greedy answer per training prompt, scored by the reward stage.
            greedy = self.rollout.generate(prompts, replace(params, temperature=0.0, n=1))[mine]
            baseline = self.tokenizer.batch_decode([g[0].token_ids for g in greedy], skip_special_tokens=True)
        completions = [c for group in groups for c in group]
        n = params.n
        pids, pmask = left_pad([p.ids for p in request.prompts], self.tokenizer.pad_token_id)
        expand = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
        batch = Batch(
            prompt_ids=pids.repeat_interleave(n, 0), prompt_mask=pmask.repeat_interleave(n, 0), group_size=n,
            data_source=expand([p.data_source for p in request.prompts]),
            ground_truth=expand([p.ground_truth for p in request.prompts]),
            extra_info=expand([p.extra_info for p in request.prompts]),
            response_ids=right_pad([c.token_ids for c in completions], self.tokenizer.pad_token_id, torch.long),
            response_mask=right_pad([[1.0] * len(c.token_ids) for c in completions], 0.0, torch.float32),
            rollout_logprobs=right_pad([c.logprobs for c in completions], 0.0, torch.float32),
            finish_reason=[c.finish_reason for c in completions],
            prompt_text=expand([p.text for p in request.prompts]),
            responses=self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True),
            baseline_responses=expand(baseline), step=request.step,
        )
        batch.timing["gen"] = time.perf_counter() - start
        peak_memory("gen", batch.metrics)
        return batch

    def _tp_prompts(self, prompts: list[list[int]]) -> tuple[list[list[int]], slice]:
        """(the prompts of every rank in this TP group, in rank order; where this rank's sit):
        tensor-parallel ranks must generate the same batch together (collective in the group)."""
        if self.tp.size == 1:
            return prompts, slice(None)
        every: list[list[list[int]]] = [[] for _ in range(self.tp.size)]
        torch.distributed.all_gather_object(every, prompts, group=self.tp.group)
        start = sum(len(x) for x in every[:self.tp.rank])
        return [p for x in every for p in x], slice(start, start + len(prompts))

    def _to_generation(self) -> None:
        """Give generation the memory training holds only between updates (per config)."""
        if self.cfg.actor.offload_optimizer:
            self.engine.offload()
        if self.cfg.rollout.free_cache:
            self.rollout.resume_memory()

    def _to_training(self) -> None:
        if self.cfg.rollout.free_cache:
            self.rollout.release_memory()
        self.engine.onload()

    # -- training --------------------------------------------------------------------------
    def logprobs(self, batch: Batch) -> Batch:
        """Old-policy logprobs, plus how far they are from what the rollout engine reported.

        On-policy (one epoch, one mini-batch, no KL in the reward) the weights that generated are
        the weights the one update starts from: the update's own forward gives the old logprobs
        (detached) and the mismatch metrics, and this forward is skipped."""
        start = time.perf_counter()
        self._to_training()
        a = self.cfg.actor
        if a.ppo_epochs == 1 and a.mini_batch_prompts == self.cfg.data.prompts_per_step and \
                not self.cfg.algorithm.kl_in_reward:
            batch.timing["old_log_prob"] = time.perf_counter() - start
            return batch
        ids, mask, pos = batch.sequences()
        batch.old_logprobs, _ = response_logprobs(
            self.engine.root, ids, mask, pos, batch.response_ids, self.cfg.rollout.temperature,
            self.cfg.actor.micro_batch_tokens_per_gpu, pack=self.cfg.actor.pack_sequences)
        diff = (batch.old_logprobs.exp() - batch.rollout_logprobs.exp()).abs()
        valid = batch.response_mask.bool()
        batch.metrics["training/rollout_probs_diff_mean"] = float(diff[valid].mean())
        batch.metrics["training/rollout_probs_diff_max"] = float(diff[valid].max())
        batch.timing["old_log_prob"] = time.perf_counter() - start
        peak_memory("old_log_prob", batch.metrics)
        return batch

    def advantages(self, batch: Batch) -> Batch:
        start = time.perf_counter()
        alg, mask, rw = self.cfg.algorithm, batch.response_mask, self.cfg.reward
        scores = batch.scores
        if rw.overlong_buffer:  # DAPO: shape the reward that advantages see; the logged score stays raw
            penalty = algos.overlong_penalty(mask.sum(1), self.cfg.rollout.max_new_tokens, rw.overlong_buffer,
                                             rw.overlong_penalty)
            scores = scores + penalty
            batch.metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
        token_rewards = None
        if alg.kl_in_reward:
            kl = algos.kl_penalty(batch.old_logprobs, batch.ref_logprobs, alg.kl_penalty)
            token_rewards = algos.kl_in_reward(algos.on_last_token(scores, mask), kl, mask, self.kl_ctl.value)
            batch.metrics["actor/reward_kl_penalty"] = float(algos.masked_mean(kl, mask))
            batch.metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctl.value
        if alg.advantage == "gae":  # PPO: per-token advantages from the critic's values; returns are its targets
            rewards = algos.on_last_token(scores, mask) if token_rewards is None else token_rewards
            advantages, batch.returns = algos.gae(rewards, batch.values, mask, alg.gamma, alg.lam)
            batch.advantages = algos.masked_whiten(advantages, mask)
        else:
            baseline = batch.baseline_scores if alg.advantage == "remax" else None
            batch.advantages = algos.compute_advantages(
                alg.advantage, scores, mask, batch.group_size, alg.gamma, token_rewards, baseline)
        batch.timing["adv"] = time.perf_counter() - start
        return batch

    def update(self, batch: Batch) -> dict:
        """PPO-clip epochs over mini-batches; returns the step's metrics, timings and samples.

        While the critic warms up there is no update, and no actor/ loss metrics for the step."""
        start = time.perf_counter()
        self._to_training()
        warming = batch.step < self.cfg.critic.warmup_steps
        metrics = {} if warming else self._ppo_epochs(batch)
        batch.timing["update_actor"] = time.perf_counter() - start
        peak_memory("update_actor", metrics)
        metrics["actor/skipped_steps"] = self.engine.skipped_steps
        metrics["actor/consecutive_skipped_steps"] = self.engine.consecutive_skips
        return {"metrics": {**batch_metrics(batch), **metrics}, "timing": batch.timing,
                "samples": samples(batch, 4)}

    def _ppo_epochs(self, batch: Batch) -> dict[str, float]:
        a = self.cfg.actor
        rows = a.mini_batch_prompts // self.world * batch.group_size
        stats: dict[str, list[float]] = {}
        for _ in range(a.ppo_epochs):
            for lo in range(0, len(batch), rows):
                mini = batch.rows(slice(lo, lo + rows))
                out = self.engine.step(partial(self._micro_losses, mini, stats))
                for k in ("grad_norm", "lr"):
                    stats.setdefault(f"actor/{k}", []).append(out[k])
                stats.setdefault("actor/pg_loss", []).append(all_reduce_sum(out["loss"]))
        if self.cfg.algorithm.kl_in_reward:
            self.kl_ctl.update(batch.metrics["actor/reward_kl_penalty"], len(batch))
        self.sync_rollout()
        return {k: float(np.max(v) if k.endswith("_max") else np.mean(v)) for k, v in stats.items()}

    def _micro_losses(self, mini: Batch, stats: dict[str, list[float]]) -> list:
        a, mask = self.cfg.actor, mini.response_mask
        seq_mode = a.loss_agg != "token-mean"
        denom = all_reduce_sum(float(len(mini)) if seq_mode else float(mask.sum()))
        ids, attn, pos = mini.sequences()
        return [partial(self._loss, mini, r, ids, attn, pos, denom, stats)
                for r in micro_batches(attn, a.micro_batch_tokens_per_gpu, a.pack_sequences)]

    def _loss(self, mini: Batch, r: torch.Tensor, ids, attn, pos, denom: float, stats) -> torch.Tensor:
        """One micro-batch's loss, computed on the model's device."""
        a = self.cfg.actor
        logp, entropy = forward_logprobs(self.engine.root, ids[r], attn[r], pos[r], mini.response_ids[r],
                                         self.cfg.rollout.temperature, a.pack_sequences)
        on = lambda x: x[r].to(logp.device)  # noqa: E731
        mask = on(mini.response_mask)
        if mini.old_logprobs.numel():
            old = on(mini.old_logprobs)
        else:  # on-policy: these weights generated the batch (see `logprobs`)
            old = logp.detach()
            diff = (old.exp() - on(mini.rollout_logprobs).exp()).abs()[mask.bool()]
            stats.setdefault("training/rollout_probs_diff_mean", []).append(float(diff.mean()))
            stats.setdefault("training/rollout_probs_diff_max", []).append(float(diff.max()))
        norm_len = self.cfg.rollout.max_new_tokens
        loss, m = algos.policy_loss(logp, old, on(mini.advantages), mask, a.clip_low,
                                    a.clip_high, a.dual_clip or None, a.loss_agg, denom, norm_len, a.policy_loss)
        stats.setdefault("actor/entropy", []).append(float(algos.masked_mean(entropy.detach(), mask)))
        if a.entropy_coef:
            loss = loss - a.entropy_coef * algos.agg_loss(entropy, mask, a.loss_agg, denom, norm_len)
        if mini.ref_logprobs.numel():  # a reference stage ran
            kl = algos.kl_penalty(logp, on(mini.ref_logprobs), a.kl_loss_type)
            stats.setdefault("actor/kl_loss", []).append(float(algos.masked_mean(kl.detach(), mask)))
            if a.kl_loss_coef:
                loss = loss + a.kl_loss_coef * algos.agg_loss(kl, mask, a.loss_agg, denom, norm_len)
        for k, v in m.items():
            stats.setdefault(f"actor/{k}", []).append(float(v))
        return loss

    def sft_update(self, pairs: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        """One supervised optimizer step: next-token cross-entropy on the response tokens only, a
        mean over every rank's response tokens (the loss and optimizer numbers are all ranks')."""
        batch = self._sft_batch(pairs)
        ids, attn, pos = batch.sequences()
        denom = all_reduce_sum(float(batch.response_mask.sum()))

        a = self.cfg.actor

        def loss(r: torch.Tensor) -> torch.Tensor:
            logp, _ = forward_logprobs(self.engine.root, ids[r], attn[r], pos[r], batch.response_ids[r],
                                       1.0, a.pack_sequences, entropy=False)
            return -(logp * batch.response_mask[r].to(logp.device)).sum() / denom

        chunks = micro_batches(attn, a.micro_batch_tokens_per_gpu, a.pack_sequences)
        out = self.engine.step(lambda: [partial(loss, r) for r in chunks])
        self.sync_rollout()
        return {"sft/loss": all_reduce_sum(out["loss"]), "sft/grad_norm": out["grad_norm"], "sft/lr": out["lr"],
                "actor/skipped_steps": self.engine.skipped_steps,
                "actor/consecutive_skipped_steps": self.engine.consecutive_skips}

    def sft_eval(self, pairs: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        """This rank's summed response-token NLL and token count, without a gradient."""
        batch = self._sft_batch(pairs)
        ids, attn, pos = batch.sequences()
        logp, _ = response_logprobs(self.engine.root, ids, attn, pos, batch.response_ids, 1.0,
                                    self.cfg.actor.micro_batch_tokens_per_gpu, pack=self.cfg.actor.pack_sequences)
        return {"nll": float(-(logp * batch.response_mask).sum()), "tokens": float(batch.response_mask.sum())}

    def _sft_batch(self, pairs: list[tuple[list[int], list[int]]]) -> Batch:
        pids, pmask = left_pad([p for p, _ in pairs], self.tokenizer.pad_token_id)
        return Batch(pids, pmask, 1, [], [], [],
                     response_ids=right_pad([r for _, r in pairs], self.tokenizer.pad_token_id, torch.long),
                     response_mask=right_pad([[1.0] * len(r) for _, r in pairs], 0.0, torch.float32))

    # -- preference training -------------------------------------------------------------
    def dpo_update(self, batch: Batch) -> dict:
        """DPO optimizer steps over pair rows (chosen then rejected, group_size 2) that carry the
        reference's logprobs, `actor.mini_batch_prompts` pairs (over all ranks) per step.

        Returns {"sums": per-pair statistics summed over this rank's pairs, "pairs": B,
        "metrics": optimizer numbers, "timing": ...}; the driver divides the sums over all ranks.
        """
        start = time.perf_counter()
        rows = 2 * (self.cfg.actor.mini_batch_prompts // self.world)
        sums: dict[str, float] = {}
        grad_norms = []
        for lo in range(0, len(batch), rows):
            out = self.engine.step(partial(self._dpo_micro_losses, batch.rows(slice(lo, lo + rows)), sums))
            grad_norms.append(out["grad_norm"])
        self.sync_rollout()
        batch.timing["update_actor"] = time.perf_counter() - start
        metrics = {"dpo/grad_norm": float(np.mean(grad_norms)), "dpo/lr": out["lr"],
                   "actor/skipped_steps": self.engine.skipped_steps,
                   "actor/consecutive_skipped_steps": self.engine.consecutive_skips}
        return {"sums": sums, "pairs": len(batch) // 2, "metrics": metrics, "timing": batch.timing}

    def dpo_eval(self, batch: Batch) -> dict:
        """The DPO loss and implicit rewards of pair rows, without a gradient; shaped like `dpo_update`'s."""
        start = time.perf_counter()
        ids, attn, pos = batch.sequences()
        logp, _ = response_logprobs(self.engine.root, ids, attn, pos, batch.response_ids, 1.0,
                                    self.cfg.actor.micro_batch_tokens_per_gpu, pack=self.cfg.actor.pack_sequences)
        sums: dict[str, float] = {}
        self._dpo_pairs_loss(logp, batch.ref_logprobs, batch.response_mask, sums)
        batch.timing["dpo_eval"] = time.perf_counter() - start
        return {"sums": sums, "pairs": len(batch) // 2, "timing": batch.timing}

    def _dpo_micro_losses(self, mini: Batch, sums: dict[str, float]) -> list:
        a = self.cfg.actor
        ids, attn, pos = mini.sequences()  # [2b, L]
        pairs = len(mini) // 2
        denom = all_reduce_sum(float(pairs))  # the loss is a mean over every rank's pairs
        # micro-batches of whole pairs: a pair's two rows side by side make one [b, 2L] row
        chunks = micro_batches(attn.reshape(pairs, -1), a.micro_batch_tokens_per_gpu, a.pack_sequences)
        return [partial(self._dpo_loss, mini, torch.stack([2 * c, 2 * c + 1], 1).flatten(), ids, attn, pos,
                        denom, sums) for c in chunks]

    def _dpo_loss(self, mini: Batch, r: torch.Tensor, ids, attn, pos, denom: float, sums) -> torch.Tensor:
        # DPO compares the models' own distributions: temperature 1, as the reference scores them
        logp, _ = forward_logprobs(self.engine.root, ids[r], attn[r], pos[r], mini.response_ids[r], 1.0,
                                   self.cfg.actor.pack_sequences, entropy=False)
        loss = self._dpo_pairs_loss(logp, mini.ref_logprobs[r].to(logp.device), mini.response_mask[r].to(logp.device),
                                    sums)
        return loss * (len(r) // 2) / denom

    def _dpo_pairs_loss(self, logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor,
                        sums: dict[str, float]) -> torch.Tensor:
        """Mean DPO loss of [2b, R] pair rows; adds the b pairs' summed statistics to `sums`."""
        seq = (logp * mask).sum(1).view(-1, 2)  # [b, 2]: chosen, rejected
        ref_seq = (ref * mask).sum(1).view(-1, 2)
        loss, m = algos.dpo_loss(seq[:, 0], seq[:, 1], ref_seq[:, 0], ref_seq[:, 1], self.cfg.dpo.beta)
        b = len(seq)
        for key, value in {"loss": loss.detach(), **{DPO_NAMES[k]: v for k, v in m.items()}}.items():
            sums[key] = sums.get(key, 0.0) + float(value) * b
        return loss

    # -- state -----------------------------------------------------------------------------
    def save(self, directory: str) -> None:
        """Write this rank's part of a checkpoint into `directory` (a temp dir the driver seals):
        rank 0 the full model as a HF directory, every rank its optimizer shard (torch distributed
        checkpoint, loadable at another world size) and its RNG state."""
        d = Path(directory)
        full = self.engine.full_state_dict()  # collective; the tensors land on rank 0
        if self.rank == 0:
            save_file(_untie(full), d / "model.safetensors", metadata={"format": "pt"})
            self.engine.model.config.save_pretrained(d)  # with the tokenizer: a loadable HF directory
            self.tokenizer.save_pretrained(d)
        dcp.save(self.engine.state_dict(), checkpoint_id=d / "trainer")
        nps = np.random.get_state(legacy=False)
        rng = {"python": list(random.getstate()[1]), "torch": torch.get_rng_state(),
               "numpy": [torch.tensor(nps["state"]["key"].tolist(), dtype=torch.int64), int(nps["state"]["pos"]),
                         int(nps["has_gauss"]), float(nps["gauss"])], "kl": self.kl_ctl.value,
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        torch.save(rng, d / f"worker_{self.rank}.pt")

    def load(self, directory: str) -> None:
        d = Path(directory)
        self.engine.load_full_state_dict(load_file(d / "model.safetensors"))
        state = self.engine.state_dict()
        checkpoint.load_shards(state, d / "trainer")
        self.engine.load_state_dict(state)
        own = d / f"worker_{self.rank}.pt"
        if own.exists():  # a checkpoint from fewer ranks has no RNG state for this one
            rng = torch.load(own, weights_only=True)
            torch.set_rng_state(rng["torch"])
            random.setstate((3, tuple(rng["python"]), None))
            keys, pos, has_gauss, gauss = rng["numpy"]
            np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
            self.kl_ctl.value = rng["kl"]
        self.sync_rollout()

    def export(self, directory: str) -> None:
        """A HF directory (safetensors, config, tokenizer) that from_pretrained loads; every rank
        calls it, rank 0 writes."""
        full = self.engine.full_state_dict()
        if self.rank == 0:
            self.engine.model.save_pretrained(directory, state_dict=full)
            self.tokenizer.save_pretrained(directory)


def peak_memory(phase: str, metrics: dict[str, float]) -> None:
    """`perf/max_memory_allocated_gb/<phase>`: this process's CUDA peak since the last phase ended."""
    if torch.cuda.is_available():
        metrics[f"perf/max_memory_allocated_gb/{phase}"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()


DPO_NAMES = {"rewards/chosen": "chosen_reward", "rewards/rejected": "rejected_reward",
             "rewards/margin": "reward_margin", "rewards/accuracy": "reward_accuracy"}


def _untie(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: give tied tensors (embeddings/lm_head) their own."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        out[k] = v.clone() if v.data_ptr() in seen else v
        seen.add(v.data_ptr())
    return out


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Per-step statistics of what was generated and how it scored."""
    lengths = batch.response_mask.sum(1)
    out = dict(batch.metrics)
    out.update({
        "critic/score/mean": float(batch.scores.mean()), "critic/score/max": float(batch.scores.max()),
        "critic/score/min": float(batch.scores.min()),
        "critic/advantages/mean": float(algos.masked_mean(batch.advantages, batch.response_mask)),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(np.mean([f == "length" for f in batch.finish_reason])),
        "prompt_length/mean": float(batch.prompt_mask.sum(1).float().mean()),
        "perf/total_num_tokens": float(batch.prompt_mask.sum() + batch.response_mask.sum()),
    })
    return out


def samples(batch: Batch, k: int) -> list[dict]:
    return [{"prompt": batch.prompt_text[i], "response": batch.responses[i], "ground_truth": batch.ground_truth[i],
             "score": float(batch.scores[i]), "finish_reason": batch.finish_reason[i]}
            for i in range(0, len(batch), max(1, batch.group_size))][:k]
