"""GRPO (and its group-baseline relatives), and PPO with a critic, from prompts to gradients, on Ray,
tracked in MLflow.

Algorithm: for each prompt sample G responses; score them with rule rewards; the advantage of a
response is its reward minus the group mean, over the group std (`algorithm.advantage` swaps in
Dr.GRPO, RLOO, REINFORCE++, or ReMax's greedy-answer baseline); update the policy with the PPO-clip
loss (`actor.policy_loss` swaps in GSPO's sequence ratio or CISPO's clipped IS weight; optionally
with a k3 KL loss to the frozen reference). DAPO is this file plus config: clip-higher,
token-mean loss, overlong reward shaping, and dynamic sampling, which the driver runs before the
graph (`dynamic_sample`). No reward model in this file.

PPO is this file plus a critic (`algorithm.advantage=gae`, conf/ppo.yaml): a value model, trained
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

Run: `rlflow train [conf/x.yaml] [key=value ...]`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from engine import algos
from engine.batch import Batch, RolloutRequest, Update
from engine.config import Config
from engine.data.prompts import Prompt, PromptLoader, load_prompts
from engine.tracking import Tracker
from engine.train.fsdp import balance
from engine.train.losses import PolicyGradient
from pipelines import driver
from pipelines.runtime import SUBMIT, Generator, Group, Stages, launch, wait
from stages.advantage import Advantage
from stages.critic import Critic
from stages.policy import Policy
from stages.reference import Reference
from stages.reward import Reward


def step_graph(stages: Stages, inputs: list[Any], loss: PolicyGradient, sampled: bool = False) -> tuple[list[Any],
                                                                                                      list[Any]]:
    """The step's dataflow, one chain per rank, over stages bound to a call mode.

    Inputs are RolloutRequests, or with `sampled` the scored batches dynamic sampling kept.
    Returns each rank's Update (what the driver reads) and the weight sync that follows (waited for)."""
    assert stages.generator is not None and stages.reward is not None and stages.advantage is not None
    updates = []
    for rank, batch in enumerate(inputs):
        if not sampled:
            batch = stages.generator.at(rank, Generator.generate, batch)  # G samples per prompt, with logprobs
            batch = stages.reward.at(rank, Reward.score, batch)  # rule reward per response
        if stages.reference is not None:
            batch = stages.reference.at(rank, Reference.logprobs, batch)  # anchor for the KL loss
        batch = stages.policy.at(rank, Policy.logprobs, batch)  # old-policy logprobs for the PPO ratio
        if stages.critic is not None:
            batch = stages.critic.at(rank, Critic.values, batch)  # the baseline of every token, for GAE
        batch = stages.advantage.at(rank, Advantage.estimate, batch)  # group-relative, or GAE with the values
        if stages.critic is not None:  # before the policy's, so every rank runs their collectives in one order
            batch = stages.critic.at(rank, Critic.update, batch)  # clipped value regression on the GAE returns
        updates.append(stages.policy.at(rank, Policy.update, batch, loss))  # PPO-clip epochs over mini-batches
    return updates, stages.sync.after_update(updates)  # colocated: nothing; split: push to the rollout pool


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
    assert generator is not None and reward is not None
    gen, score = generator.bound(SUBMIT), reward.bound(SUBMIT)
    refs = []
    for rank, part in enumerate(shards(prompts, gen.size)):
        batch = gen.at(rank, Generator.generate, RolloutRequest(part, step, greedy, samples))
        refs.append(score.at(rank, Reward.score, batch) if part else batch)
    return wait(refs, SUBMIT, gen.timeout)


def validate(stages: Stages, prompts: list[Prompt], step: int, k: int) -> dict[str, float]:
    """Held-out scores per data_source and overall: greedy, and with k > 0 mean@k and pass@j (j = 2, 4 .. k).

    A sample passes when it scores >= 1, a rule reward's full marks.
    """
    greedy = rollout(stages.generator, stages.reward, prompts, step, greedy=True)
    out = prompt_means(greedy, {"greedy_score": lambda s: s[0]})
    if k:
        stats: dict[str, Callable[[list[float]], float]] = {f"mean_at_{k}": lambda s: sum(s) / len(s)}
        for j in sorted({2 ** i for i in range(1, k.bit_length())} | {k} - {1}):
            stats[f"pass_at_{j}"] = partial(passed, j)
        out.update(prompt_means(rollout(stages.generator, stages.reward, prompts, step, samples=k), stats))
    return out


def passed(k: int, scores: list[float]) -> float:
    """Unbiased pass@k of one prompt's sampled scores."""
    return algos.pass_at_k(len(scores), sum(x >= 1.0 for x in scores), k)


def prompt_means(batches: list[Batch], stats: dict[str, Callable[[list[float]], float]]) -> dict[str, float]:
    """`val/<data_source>/<stat>` and `val/<stat>`: each stat of one prompt's scores, averaged over prompts."""
    scores: dict[str, list[list[float]]] = {}  # data_source -> one list of sample scores per prompt
    for b in batches:
        for i, row in enumerate(b.scores.view(-1, b.group_size).tolist()):
            scores.setdefault(b.data_source[i * b.group_size], []).append(row)
    out = {}
    for name, stat in stats.items():
        values = {source: [stat(row) for row in rows] for source, rows in scores.items()}
        out.update({f"val/{source}/{name}": sum(v) / len(v) for source, v in values.items()})
        every = [x for v in values.values() for x in v]
        out[f"val/{name}"] = sum(every) / len(every)
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


def dynamic_sample(stages: Stages, loader: PromptLoader, step: int, tries: int) -> tuple[Batch, dict[str, float]]:
    """Generate and score rounds of prompts until a step's worth of groups whose rewards differ is
    found, or `tries` rounds ran; then top up with groups that all agree (no learning signal, counted)
    so that every step has the same shape."""
    want = loader.batch_size
    batches: list[Batch] = []
    timing: dict[str, float] = {}
    for _ in range(tries):
        scored = rollout(stages.generator, stages.reward, loader.next_batch(), step)
        for key in scored[0].timing:  # ranks run in parallel, rounds one after another
            timing[key] = timing.get(key, 0.0) + max(b.timing[key] for b in scored)
        batches += scored
        if sum(int(algos.varied_groups(b.scores, b.group_size).sum()) for b in batches) >= want:
            break
    pool = Batch.cat(batches)
    kept = pool.rows(algos.dynamic_sampling_rows(pool.scores, pool.group_size, want))
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

    def graph(self, stages: Stages, inputs: list[Any]) -> tuple[list[Any], list[Any]]:
        return step_graph(stages, inputs, self.loss, sampled=self.tries > 0)

    def launch(self) -> Stages:
        c = self.cfg
        return launch(c, self.model_path, advantage=True,
                      reference=bool(c.actor.kl_loss_coef or c.algorithm.kl_in_reward),
                      critic=c.algorithm.advantage == "gae")

    def inputs(self, stages: Stages, loader: PromptLoader, step: int) -> tuple[list[Any], dict[str, float]]:
        """RolloutRequests, or with DAPO's dynamic sampling the scored batches it kept."""
        if not self.tries:
            return [RolloutRequest(s, step) for s in shards(loader.next_batch(), stages.workers)], {}
        kept, metrics = dynamic_sample(stages, loader, step, self.tries)
        return balanced_shards(kept, stages.workers, self.cfg.actor.mini_batch_prompts), metrics

    def metrics(self, outputs: list[Update], seconds: float) -> dict[str, float]:
        return merge(outputs, seconds, len(outputs))

    def samples(self, outputs: list[Update]) -> list[dict]:
        return [s for u in outputs for s in u.samples]

    def validate(self, stages: Stages, step: int) -> dict[str, float]:
        return validate(stages, self.val_prompts, step, self.cfg.trainer.val_samples)

    def headline(self, m: dict[str, float], validation: bool) -> str:
        if validation:
            return f"greedy score {m['val/greedy_score']:.4f}"
        return f"reward {m['critic/score/mean']:.3f} tok/s {m['perf/throughput']:.0f}"


def train(cfg: Config, model_path: str, files: dict[str, list[str]], tracker: Tracker) -> Path:
    """The RL run; returns the exported HF directory of the final policy."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_prompts, counts = load_prompts(files["train"], tokenizer, cfg.data.max_prompt_tokens,
                                         cfg.data.overlong_prompts)
    val_prompts, _ = load_prompts(files["val"], tokenizer, cfg.data.max_prompt_tokens, cfg.data.overlong_prompts)
    tracker.log_metrics({f"data/{k}": v for k, v in counts.items()}, step=0)
    loader = PromptLoader(train_prompts, cfg.data.prompts_per_step, cfg.trainer.seed)
    return driver.run(cfg, GRPO(cfg, model_path, val_prompts[:cfg.data.val_max_prompts or None]), loader, tracker)
