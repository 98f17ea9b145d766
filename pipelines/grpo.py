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
new weights, which the pool takes as it starts its next batch (`pipelines/ahead.py`).
The graph then takes scored batches, as with dynamic sampling. k = 1 is one step off, with the
same versions every run; from k = 2 the pool never idles, and a batch's version depends on timing.

Run: `rlflow train [RECIPE] [key=value ...]` (`rlflow recipes` lists them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from rlflow.pipelines.ahead import Ahead
from rlflow.pipelines.runtime import Generator, Stages, launch, rollout, shards
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

    def __init__(self, cfg: Config, model_path: str, val_prompts: list[Prompt], tracker: Tracker | None = None) -> None:
        self.cfg, self.model_path, self.val_prompts = cfg, model_path, val_prompts
        self.tries = cfg.algorithm.dynamic_sampling_tries  # > 0: the driver generates and filters before the graph
        self.loss = PolicyGradient(cfg)
        self.greedy_baseline = estimator_of(cfg.algorithm.advantage).greedy_baseline  # a scored greedy answer too
        # the coming steps' batches generating during this one's update (trainer.max_staleness > 0)
        self.ahead = Ahead(cfg, model_path, tracker) if cfg.trainer.max_staleness else None

    def graph(self, stages: Stages, inputs: list[Any]) -> tuple[list[Any], list[Any]]:
        return step_graph(stages, inputs, self.loss, sampled=self.tries > 0 or self.ahead is not None,
                          sync=self.ahead is None)

    def launch(self) -> Stages:
        c = self.cfg
        if self.ahead:
            self.ahead.reset()
        return launch(c, self.model_path, advantage=True,
                      reference=bool(c.actor.kl_loss_coef or c.algorithm.kl_coef),
                      critic=estimator_of(c.algorithm.advantage).critic)

    def inputs(self, stages: Stages, loader: PromptLoader, step: int) -> tuple[list[Any], dict[str, float]]:
        """RolloutRequests (for ReMax, then a greedy one per rank), or with DAPO's dynamic sampling
        the scored batches it kept, or generating ahead the scored batches generated during the
        last steps (generated now at a run's first step and after a resume)."""
        if self.ahead:
            return self.ahead.batches(stages, loader, step), {"async/rollout_rebuilds": float(self.ahead.rebuilds)}
        if not self.tries:
            parts = shards(loader.next_batch(), stages.workers)
            greedy = [RolloutRequest(s, step, greedy=True) for s in parts] if self.greedy_baseline else []
            return [RolloutRequest(s, step) for s in parts] + greedy, {}
        kept, metrics = dynamic_sample(stages, loader, step, self.tries, self.greedy_baseline)
        return balanced_shards(kept, stages.workers, self.cfg.actor.mini_batch_prompts), metrics

    def after_step(self, stages: Stages, outputs: list[Update]) -> None:
        if self.ahead:  # the rollout pool takes this step's weights beside the batches queued on it
            self.ahead.push(stages, outputs)

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
    return driver.run(cfg, GRPO(cfg, model_path, val_prompts[:cfg.data.val_max_prompts or None], tracker), loader,
                      tracker)
