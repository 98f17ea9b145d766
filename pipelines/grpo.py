"""GRPO (and its group-baseline relatives), and PPO with a critic, from prompts to gradients, on Ray,
tracked in MLflow.

Algorithm: for each prompt sample G responses; score them with rule rewards; the advantage of a
response is its reward minus the group mean, over the group std (`algorithm.advantage` swaps in
Dr.GRPO, RLOO, REINFORCE++, or ReMax's greedy-answer baseline); update the policy with the PPO-clip
loss (`actor.policy_loss` swaps in GSPO's sequence ratio or CISPO's clipped IS weight; optionally
with a k3 KL loss to the frozen reference). DAPO is this file plus config: clip-higher,
token-mean loss, overlong reward shaping, and dynamic sampling, which the driver runs before the
graph (`dynamic_sample`). No reward model in this file.

PPO is this file plus a critic (`algorithm.advantage=gae`, the `demo-ppo` recipe): a value model, trained
with its own optimizer on the same mini-batches, gives per-token values; the score sits on the last
response token; GAE(gamma, lambda) turns rewards and values into whitened advantages for the policy
and returns for the critic. For the first `critic.warmup_steps` steps only the critic learns. It
drops PPO's value-loss-in-the-policy-loss (separate optimizers) and shared actor/critic weights.

One step, per data-parallel rank (`step_graph`):
    generate -> score -> [reference logprobs] -> old logprobs -> [values] -> advantages -> [critic update]
    -> update -> weight sync
The same graph is either compiled once into a Ray compiled DAG (`trainer.dag=compiled`) or run
as chained `.remote()` calls (`plain`); both execute the same stage verbs in the same order, so a
seed gives identical metrics. Validation, dynamic sampling, checkpoints and logging stay in the
driver loop (pipelines/driver.py), between executions.

Placement: the policy generates with its own rollout engine (colocated), or with `placement.own_pool`
listing rollout a pool of Rollout workers does (split), rank r for the policy's rank r. The step
graph does not ask which: `stages.generator` generates, and `stages.sync` moves the new weights
(pipelines/runtime.py). The samples (seeded per step and rank), and so the metrics, are the same
in both placements.

Asynchronous (`trainer.max_staleness` = k > 0, split only): the driver keeps the next k steps'
generations queued on the rollout pool while the trainer updates, and after the graph pushes the
new weights, which the pool takes as it starts its next batch (`GRPO._ahead`, `GRPO.after_step`).
The graph then takes scored batches, as with dynamic sampling. k = 1 is one step off, with the
same versions every run; from k = 2 the pool never idles, and a batch's version depends on timing.

Run: `rlflow train [RECIPE] [key=value ...]` (`rlflow recipes` lists them).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import AutoTokenizer

from rlflow.engine import algos
from rlflow.engine.agents.env import offered_tools
from rlflow.engine.batch import Batch, RolloutRequest, Update
from rlflow.engine.config import Config, estimator_of
from rlflow.engine.data.prompts import Prompt, PromptLoader, load_prompts
from rlflow.engine.tracking import Tracker
from rlflow.engine.train.batching import balance
from rlflow.engine.train.losses import PolicyGradient
from rlflow.pipelines import driver
from rlflow.pipelines.runtime import (
    SUBMIT,
    WORKER_LOST,
    Generator,
    Group,
    Stages,
    how_lost,
    launch,
    rebuild_rollout,
    rollout_lost,
    settle,
    wait,
)
from rlflow.stages.advantage import Advantage
from rlflow.stages.critic import Critic
from rlflow.stages.policy import Policy
from rlflow.stages.reference import Reference
from rlflow.stages.reward import Reward


def step_graph(stages: Stages, inputs: list[Any], loss: PolicyGradient, sampled: bool = False,
               sync: bool = True) -> tuple[list[Any], list[Any]]:
    """The step's dataflow, one chain per rank, over stages bound to a call mode.

    Inputs are one RolloutRequest per rank, or with `sampled` scored batches (those dynamic sampling
    kept, or generated ahead); for ReMax (not sampled) each rank's greedy request follows, at
    `inputs[workers + rank]`. Returns each rank's Update (what the driver reads) and the weight sync
    that follows (waited for; none without `sync`, when the driver moves the weights itself)."""
    assert stages.generator is not None and stages.reward is not None and stages.advantage is not None
    updates = []
    n = stages.workers
    for rank, batch in enumerate(inputs[:n]):
        baseline = None
        if not sampled:
            batch = stages.generator.at(rank, Generator.generate, batch)  # G samples per prompt, with logprobs
            batch = stages.reward.at(rank, Reward.score, batch)  # rule reward per response
            if len(inputs) > n:  # ReMax: the greedy answer of each prompt, scored alike
                baseline = stages.reward.at(rank, Reward.score,
                                            stages.generator.at(rank, Generator.generate, inputs[n + rank]))
        if stages.reference is not None:
            batch = stages.reference.at(rank, Reference.logprobs, batch)  # anchor for the KL loss
        batch = stages.policy.at(rank, Policy.logprobs, batch)  # old-policy logprobs for the PPO ratio
        if stages.critic is not None:
            batch = stages.critic.at(rank, Critic.values, batch)  # the baseline of every token, for GAE
        batch = stages.advantage.at(rank, Advantage.estimate, batch, baseline)  # group-relative, or GAE
        if stages.critic is not None:  # before the policy's, so every rank runs their collectives in one order
            batch = stages.critic.at(rank, Critic.update, batch)  # clipped value regression on the GAE returns
        updates.append(stages.policy.at(rank, Policy.update, batch, loss))  # PPO-clip epochs over mini-batches
    return updates, stages.sync.after_update(updates) if sync else []  # colocated: nothing; split: a push


def shards(prompts: list[Prompt], n: int) -> list[list[Prompt]]:
    """Every prompt, in n contiguous shards whose sizes differ by at most one (equal when n divides
    them, as a training step's do), so every prompt's group stays on one rank."""
    return [prompts[i * len(prompts) // n:(i + 1) * len(prompts) // n] for i in range(n)]


def rollout(generator: Group[Generator] | None, reward: Group[Reward] | None, prompts: list[Prompt], step: int,
            greedy: bool = False, samples: int = 0) -> list[Batch]:
    """Generate and score `prompts` over the ranks with plain calls, outside the step graph
    (validation, dynamic sampling, `rlflow eval`).

    Every rank generates (tensor-parallel ranks generate together), also one left without a
    prompt when there are fewer prompts than ranks; its empty batch is not scored."""
    assert generator is not None
    return wait(submit_rollout(generator, reward, prompts, step, greedy, samples), SUBMIT, generator.timeout)


def submit_rollout(generator: Group[Generator], reward: Group[Reward] | None, prompts: list[Prompt], step: int,
                   greedy: bool = False, samples: int = 0) -> list[Any]:
    """`rollout`'s calls, submitted and not waited for: each rank's scored batch, to come (without
    `reward`, its generated batch)."""
    gen, score = generator.bound(SUBMIT), reward.bound(SUBMIT) if reward else None
    refs = []
    for rank, part in enumerate(shards(prompts, gen.size)):
        batch = gen.at(rank, Generator.generate, RolloutRequest(part, step, greedy, samples))
        refs.append(score.at(rank, Reward.score, batch) if part and score else batch)
    return refs


def validate(stages: Stages, prompts: list[Prompt], step: int, k: int) -> dict[str, float]:
    """Held-out scores (`summarise`, as `val/...`) of one greedy answer and, with k > 0, k samples a prompt."""
    greedy = rollout(stages.generator, stages.reward, prompts, step, greedy=True)
    sampled = rollout(stages.generator, stages.reward, prompts, step, samples=k) if k else []
    return summarise("val/", [s for b in greedy for s in b.data_source], [float(x) for b in greedy for x in b.scores],
                     [row for b in sampled for row in b.scores.view(-1, k).tolist()])


def summarise(prefix: str, sources: list[str], greedy: list[float], sampled: list[list[float]]) -> dict[str, float]:
    """`<prefix><stat>` over every prompt and `<prefix><data_source>/<stat>` per data_source, each a
    mean over prompts of: `greedy_score` (the greedy answer's score), `accuracy` (whether it scores
    >= 1, a rule reward's full marks) and, given n samples a prompt, `mean_at_<n>` and the unbiased
    `pass_at_<j>` (j = 1, 2, 4 .. n; a sample passes at >= 1); and `prompts`, how many there were.
    Training's validation and `rlflow eval` both report these."""
    groups: dict[str, list[int]] = {prefix: list(range(len(sources)))}
    for i, source in enumerate(sources):
        groups.setdefault(f"{prefix}{source}/", []).append(i)
    n = len(sampled[0]) if sampled else 0
    out = {}
    for p, rows in groups.items():
        out[f"{p}prompts"] = float(len(rows))
        out[f"{p}greedy_score"] = sum(greedy[i] for i in rows) / len(rows)
        out[f"{p}accuracy"] = sum(greedy[i] >= 1.0 for i in rows) / len(rows)
        if n:
            out[f"{p}mean_at_{n}"] = sum(sum(sampled[i]) / n for i in rows) / len(rows)
            for j in sorted({2 ** i for i in range(n.bit_length())} | {n}):
                out[f"{p}pass_at_{j}"] = sum(algos.pass_at_k(n, sum(s >= 1.0 for s in sampled[i]), j)
                                             for i in rows) / len(rows)
    return out


def balanced_shards(batch: Batch, workers: int, mini_prompts: int) -> list[Batch]:
    """Whole prompt groups per rank, each mini-batch's tokens spread evenly over the ranks: every
    optimizer step waits for its slowest rank. Rank r's k-th mini-batch is its part of the k-th."""
    g = batch.group_size
    tokens = (batch.prompt_mask.sum(1) + batch.response_mask.sum(1)).view(-1, g).sum(1).tolist()  # per group
    ranks: list[list[int]] = [[] for _ in range(workers)]
    for lo in range(0, len(tokens), mini_prompts):
        for rank, part in enumerate(balance(tokens[lo:lo + mini_prompts], workers)):
            ranks[rank] += [(lo + i) * g + j for i in sorted(part) for j in range(g)]
    return [batch.rows(torch.tensor(rows)) for rows in ranks]


def dynamic_sample(stages: Stages, loader: PromptLoader, step: int, tries: int,
                   greedy_baseline: bool = False) -> tuple[Batch, dict[str, float]]:
    """Generate and score rounds of prompts until a step's worth of groups whose rewards differ is
    found, or `tries` rounds ran; then top up with groups that all agree (no learning signal, counted)
    so that every step has the same shape. With `greedy_baseline`, the kept prompts' greedy answers are
    generated and scored too (the batch's `baseline_scores`)."""
    want = loader.batch_size
    batches: list[Batch] = []
    prompts: list[Prompt] = []  # of every round, in the order of the pooled rows' groups
    timing: dict[str, float] = {}
    for _ in range(tries):
        round_prompts = loader.next_batch()
        prompts += round_prompts
        scored = rollout(stages.generator, stages.reward, round_prompts, step)
        for key in scored[0].timing:  # ranks run in parallel, rounds one after another
            timing[key] = timing.get(key, 0.0) + max(b.timing[key] for b in scored)
        batches += scored
        if sum(int(algos.varied_groups(b.scores, b.group_size).sum()) for b in batches) >= want:
            break
    pool = Batch.cat(batches)
    rows = algos.dynamic_sampling_rows(pool.scores, pool.group_size, want)
    kept = pool.rows(rows)
    if greedy_baseline:
        greedy = rollout(stages.generator, stages.reward, [prompts[int(i)] for i in rows[::pool.group_size] //
                                                           pool.group_size], step, greedy=True)
        kept.baseline_scores = torch.cat([b.scores for b in greedy]).repeat_interleave(pool.group_size)
        timing["baseline"] = max(sum(b.timing.values()) for b in greedy)
    kept.timing = timing
    varied = int(algos.varied_groups(pool.scores, pool.group_size).sum())
    common = set.intersection(*(set(b.metrics) for b in batches))  # reward/* of every scored batch
    metrics = {k: sum(b.metrics[k] for b in batches) / len(batches) for k in common}
    metrics["dynamic_sampling/rounds"] = len(batches) / stages.workers
    metrics["dynamic_sampling/varied_groups"] = float(varied)
    metrics["dynamic_sampling/topped_up_groups"] = float(max(0, want - varied))
    return kept, metrics


def merge(results: list[Update], seconds: float, workers: int) -> dict[str, float]:
    """Mean of each rank's metrics, plus step timing and throughput."""
    metrics = {k: sum(r.metrics[k] for r in results) / len(results) for k in results[0].metrics}
    for k in results[0].timing:
        metrics[f"timing_s/{k}"] = max(r.timing[k] for r in results)
    metrics["timing_s/step"] = seconds
    tokens = sum(r.metrics["perf/total_num_tokens"] for r in results)
    metrics["perf/total_num_tokens"] = tokens
    metrics["perf/throughput"] = tokens / seconds / workers
    return metrics


class GRPO:
    """GRPO and its relatives, and PPO with a critic, for the driver loop (pipelines/driver.py)."""

    def __init__(self, cfg: Config, model_path: str, val_prompts: list[Prompt]) -> None:
        self.cfg, self.model_path, self.val_prompts = cfg, model_path, val_prompts
        self.tries = cfg.algorithm.dynamic_sampling_tries  # > 0: the driver generates and filters before the graph
        self.loss = PolicyGradient(cfg)
        self.greedy_baseline = estimator_of(cfg.algorithm.advantage).greedy_baseline  # a scored greedy answer too
        self.ahead = cfg.trainer.max_staleness  # > 0: the coming steps' batches generate during this one's update
        self.queued: deque[list[Any]] = deque()  # generating ahead: batches (refs, one per rank), a step's each
        self.rollout_rebuilds = 0  # generating ahead: rollout pools replaced while training went on

    def graph(self, stages: Stages, inputs: list[Any]) -> tuple[list[Any], list[Any]]:
        return step_graph(stages, inputs, self.loss, sampled=self.tries > 0 or self.ahead > 0, sync=not self.ahead)

    def launch(self) -> Stages:
        c = self.cfg
        self.queued.clear()  # fresh workers: what was generating went with the old ones
        return launch(c, self.model_path, advantage=True,
                      reference=bool(c.actor.kl_loss_coef or c.algorithm.kl_in_reward),
                      critic=estimator_of(c.algorithm.advantage).critic)

    def inputs(self, stages: Stages, loader: PromptLoader, step: int) -> tuple[list[Any], dict[str, float]]:
        """RolloutRequests (for ReMax, then a greedy one per rank), or with DAPO's dynamic sampling
        the scored batches it kept, or generating ahead the scored batches generated during the
        last steps (generated now at a run's first step and after a resume)."""
        if self.ahead:
            return self._ahead(stages, loader, step), {"async/rollout_rebuilds": float(self.rollout_rebuilds)}
        if not self.tries:
            parts = shards(loader.next_batch(), stages.workers)
            greedy = [RolloutRequest(s, step, greedy=True) for s in parts] if self.greedy_baseline else []
            return [RolloutRequest(s, step) for s in parts] + greedy, {}
        kept, metrics = dynamic_sample(stages, loader, step, self.tries, self.greedy_baseline)
        return balanced_shards(kept, stages.workers, self.cfg.actor.mini_batch_prompts), metrics

    def _ahead(self, stages: Stages, loader: PromptLoader, step: int) -> list[Any]:
        """This step's scored batches, once generated, with the next k = `trainer.max_staleness`
        steps' queued behind them. The pool generates each batch from the newest weights it holds
        when it starts it, and step s's is queued at step s - k, after version s - k was pushed:
        no batch is trained on by weights more than k versions newer than its own.

        The loader moves past a batch only when its step takes it: the ones ahead are peeked, so a
        checkpoint's loader position is a synchronous run's, and a resumed run generates the
        batches that were in flight again (from the checkpoint's weights), skipping no prompt."""
        assert stages.reward is not None
        while True:
            self._queue(stages, loader, step)
            try:
                generated = wait(self.queued[0], SUBMIT, stages.timeout)
                break
            except WORKER_LOST as e:  # a batch past the step timeout: the pool hangs, though it may answer
                self._rebuild_rollout(stages, e, [r for refs in self.queued for r in refs],
                                      hung=isinstance(e, TimeoutError))
        self.queued.popleft()
        loader.next_batch()
        score = stages.reward.bound(SUBMIT)
        return wait([score.at(r, Reward.score, b) for r, b in enumerate(generated)], SUBMIT, stages.timeout)

    def _queue(self, stages: Stages, loader: PromptLoader, step: int) -> None:
        """Submit the generation of this step's batch and the next k, those not queued yet."""
        assert stages.generator is not None
        while len(self.queued) <= self.ahead and step + len(self.queued) < self.cfg.trainer.total_steps:
            # generation only: a score queued now on a worker the trainer shares would hold up its
            # update (an actor runs its calls in order) until the batch exists
            ahead = len(self.queued)
            self.queued.append(submit_rollout(stages.generator, None, loader.peek_batch(ahead), step + ahead))

    def after_step(self, stages: Stages, outputs: list[Update]) -> None:
        """Generating ahead: the rollout pool receives this step's weights beside the generation
        queued on it (runtime.Broadcast), and takes them as it starts its next batch."""
        if not self.ahead:
            return
        push = stages.sync.bound(SUBMIT).after_update(outputs)
        try:
            wait(push, SUBMIT, stages.timeout)
        except (*WORKER_LOST, ray.exceptions.RayTaskError) as e:  # a push to a dead rank fails on the trainer
            self._rebuild_rollout(stages, e, push + [r for refs in self.queued for r in refs])

    def _rebuild_rollout(self, stages: Stages, e: Exception, lost: list[Any], hung: bool = False) -> None:
        """Generating ahead, a rollout worker that died or hangs is replaced while the trainer goes on:
        a new pool takes the trainer's current weights and generates the queued steps again. Any
        other loss, or more than `trainer.max_restarts` of these, goes to the driver (`e` raised),
        which rebuilds every worker from the last checkpoint. `lost`: the calls given up on; `hung`:
        the pool's generation ran past the step timeout (a worker stuck in a call still answers
        `alive` on its second thread, so only a dead or stopped one is found by asking)."""
        limit = self.cfg.trainer.max_restarts
        if self.rollout_rebuilds >= limit or not (hung or rollout_lost(stages)):
            raise e
        self.rollout_rebuilds += 1
        print(f"rlflow: a rollout worker {how_lost(e, self.cfg.trainer.step_timeout_s)} ({type(e).__name__}); "
              f"new rollout pool {self.rollout_rebuilds}/{limit}, training goes on")
        self.queued.clear()
        rebuild_rollout(self.cfg, self.model_path, stages)
        settle(lost)  # the old pool is gone: its calls have failed by now

    def metrics(self, outputs: list[Update], seconds: float) -> dict[str, float]:
        return merge(outputs, seconds, len(outputs))

    def samples(self, outputs: list[Update]) -> list[dict]:
        return [s for u in outputs for s in u.samples]

    def validate(self, stages: Stages, step: int) -> dict[str, float]:
        return validate(stages, self.val_prompts, step, self.cfg.trainer.val_samples)

    def headline(self, m: dict[str, float], validation: bool) -> str:
        if validation:
            return f"greedy score {m['val/greedy_score']:.4f}"
        errors = m.get("reward/error_rate", 0.0)  # a reward that fails scores 0: a run can learn nothing, quietly
        return f"reward {m['critic/score/mean']:.3f} tok/s {m['perf/throughput']:.0f}" + (
            f" reward errors {errors:.0%}" if errors else "")


def train(cfg: Config, model_path: str, files: dict[str, list[str]], tracker: Tracker) -> Path:
    """The RL run; returns the exported HF directory of the final policy."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tools = offered_tools(cfg.rollout.env)
    train_prompts, counts = load_prompts(files["train"], tokenizer, cfg.data.max_prompt_tokens,
                                         cfg.data.overlong_prompts, tools)
    val_prompts, _ = load_prompts(files["val"], tokenizer, cfg.data.max_prompt_tokens, cfg.data.overlong_prompts, tools)
    tracker.log_metrics({f"data/{k}": v for k, v in counts.items()}, step=0)
    loader = PromptLoader(train_prompts, cfg.data.prompts_per_step, cfg.trainer.seed)
    return driver.run(cfg, GRPO(cfg, model_path, val_prompts[:cfg.data.val_max_prompts or None]), loader, tracker)
