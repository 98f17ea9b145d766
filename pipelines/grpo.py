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
    -> update -> [push weights to the rollout pool]
The same graph is either compiled once into a Ray compiled DAG (`trainer.dag=compiled`) or run
as chained `.remote()` calls (`plain`); both execute the same stage verbs in the same order, so a
seed gives identical metrics. Validation, dynamic sampling, checkpoints and logging stay in the
driver, between executions.

Placement: the actor generates with its own rollout engine (hybrid), or with `placement.own_pool`
listing rollout a pool of Rollout workers does (split), rank r for the actor's rank r. Split, the
trainer's weights reach that pool only through the pair `actor.push_weights` + `rollout.pull_weights`,
run together on every rank: in the graph after `update`, and from the driver after a load (the
warm start needs none: the pools are built from the directory it exports). The samples (seeded
per step and rank), and so the metrics, are the same in both placements.

Run: `rlflow train [conf/x.yaml] [key=value ...]`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import AutoTokenizer

from engine import algos, checkpoint
from engine.batch import Batch, RolloutRequest
from engine.config import Config
from engine.data.prompts import Prompt, PromptLoader, load_prompts
from engine.placement import Pool
from engine.tracking import Tracker
from engine.train.fsdp import balance
from stages.actor import ActorRollout
from stages.critic import Critic
from stages.reference import Reference
from stages.reward import Reward
from stages.rollout import Rollout
from stages.worker import StageWorker


class Stages:
    """Worker pools and which pool serves each role (actor, reward, reference, critic, rollout)."""

    def __init__(self, cfg: Config, model_path: str) -> None:
        p = cfg.placement
        device = "cuda" if p.gpus_per_worker else "cpu"
        roles: dict[str, tuple[type, Callable[[int], dict]]] = {
            "actor": (ActorRollout, lambda r: dict(cfg=cfg, model_path=model_path, rank=r, world=p.workers,
                                                  device=device)),
            "reward": (Reward, lambda r: dict(cfg=cfg, device=device)),
        }
        if cfg.actor.kl_loss_coef or cfg.algorithm.kl_in_reward:
            roles["reference"] = (Reference, lambda r: dict(cfg=cfg, model_path=model_path, device=device))
        if cfg.algorithm.advantage == "gae":
            roles["critic"] = (Critic, lambda r: dict(cfg=cfg, model_path=model_path, rank=r, world=p.workers,
                                                      device=device))
        if "rollout" in p.own_pool:
            roles["rollout"] = (Rollout, lambda r: dict(cfg=cfg, model_path=model_path, rank=r, world=p.workers,
                                                        device=device))
        self.pools: dict[str, Pool] = {}
        self.roles: dict[str, str] = {}
        for role, (cls, kwargs) in roles.items():
            where = role if role in p.own_pool else "hybrid"
            if where not in self.pools:  # rule rewards need no GPU; a reward model does
                gpus = 0.0 if where == "reward" and not cfg.reward.model else p.gpus_per_worker
                # a split rollout pool needs a group only to generate tensor parallel; vLLM refuses one
                group = where != "rollout" or cfg.rollout.tp > 1
                self.pools[where] = Pool(where, StageWorker, p.workers, gpus, p.torch_threads, group=group)
            self.pools[where].add(role, cls, kwargs)
            self.roles[role] = where
        self.workers = p.workers
        self.timeout = cfg.trainer.step_timeout_s  # every wait on the workers; ray.get's compiled-graph default is 10 s
        self.generator = "rollout" if "rollout" in self.roles else "actor"  # the role whose `generate` runs
        if "rollout" in self.roles:
            self._connect()

    def worker(self, role: str, rank: int) -> Any:
        return self.pools[self.roles[role]].workers[rank]

    def _connect(self) -> None:
        """Split placement: actor rank 0 hosts the weight group and every rollout rank joins it, all at once."""
        actor = self.worker("actor", 0)
        host, port = ray.get(actor.address.remote())
        plan = ray.get(actor.run.remote("actor", "weight_plan"))
        ray.get([actor.run.remote("actor", "connect_rollout", host, port, self.workers + 1)] +
                [self.worker("rollout", r).run.remote("rollout", "connect", host, port, self.workers + 1, plan)
                 for r in range(self.workers)], timeout=self.timeout)

    def push_weights(self) -> None:
        """Split placement: the actor's weights to the rollout pool, outside the step graph (every rank at once)."""
        if "rollout" in self.roles:
            ray.get([self.worker("actor", r).run.remote("actor", "push_weights") for r in range(self.workers)] +
                    [self.worker("rollout", r).run.remote("rollout", "pull_weights") for r in range(self.workers)],
                    timeout=self.timeout)

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()


def step_graph(stages: Stages, inputs: list[Any], call: Callable,
               sampled: bool = False) -> tuple[list[Any], list[Any]]:
    """The step's dataflow, one chain per rank; `call` binds (compiled DAG) or submits (plain).

    Inputs are RolloutRequests, or with `sampled` the scored batches dynamic sampling kept.
    Returns each rank's update (what the driver reads) and, split, the weight pushes and pulls
    that follow it (waited for, not read).
    """
    updates = []
    for rank, batch in enumerate(inputs):
        def at(role: str, verb: str, x: Any, rank: int = rank) -> Any:
            return call(stages.worker(role, rank).run, role, verb, x)
        if not sampled:
            batch = at(stages.generator, "generate", batch)  # G samples per prompt, with rollout logprobs
            batch = at("reward", "score", batch)  # rule reward per response
        if "reference" in stages.roles:
            batch = at("reference", "logprobs", batch)  # anchor for the KL loss
        batch = at("actor", "logprobs", batch)  # old-policy logprobs for the PPO ratio
        if "critic" in stages.roles:
            batch = at("critic", "values", batch)  # the baseline of every token, for GAE
        batch = at("actor", "advantages", batch)  # group-relative, or GAE with the critic's values
        if "critic" in stages.roles:  # before the actor's, so every rank runs their collectives in one order
            batch = at("critic", "update", batch)  # clipped value regression on the GAE returns
        updates.append(at("actor", "update", batch))  # PPO-clip epochs over mini-batches
    if "rollout" not in stages.roles:  # hybrid: the actor's own engine takes the weights when it next generates
        return updates, []
    # Split: every actor rank pushes and every rollout rank pulls the new weights, together, after the update.
    syncs = [call(stages.worker(role, rank).run, role, verb, update)
             for role, verb in (("actor", "push_weights"), ("rollout", "pull_weights"))
             for rank, update in enumerate(updates)]
    return updates, syncs


def make_runner(cfg: Config, stages: Stages) -> tuple[Callable[[list[Any]], list[dict]], Callable]:
    """(run one step, release) for the configured execution mode."""
    sampled = cfg.algorithm.dynamic_sampling_tries > 0  # the driver generates and filters before the graph
    n = stages.workers

    def graph(inputs: list[Any], call: Callable) -> list[Any]:  # the n updates first, then any weight syncs
        updates, syncs = step_graph(stages, inputs, call, sampled)
        return updates + syncs

    if cfg.trainer.dag == "plain":
        submit = lambda method, *args: method.remote(*args)  # noqa: E731
        return (lambda xs: ray.get(graph(xs, submit), timeout=stages.timeout)[:n]), (lambda: None)
    from ray.dag import InputNode, MultiOutputNode

    bind = lambda method, *args: method.bind(*args)  # noqa: E731
    with InputNode() as inp:
        dag = MultiOutputNode(graph([inp[r] for r in range(n)], bind))
    compiled = dag.experimental_compile(_submit_timeout=stages.timeout)
    return (lambda reqs: ray.get(compiled.execute(*reqs), timeout=stages.timeout)[:n]), compiled.teardown


def shards(prompts: list[Prompt], n: int) -> list[list[Prompt]]:
    """Every prompt, in n contiguous shards whose sizes differ by at most one (equal when n divides
    them, as a training step's do), so every prompt's group stays on one rank."""
    return [prompts[i * len(prompts) // n:(i + 1) * len(prompts) // n] for i in range(n)]


def rollout(stages: Stages, prompts: list[Prompt], step: int, greedy: bool = False, samples: int = 0) -> list[Batch]:
    """Generate and score `prompts` over the ranks with plain calls, outside the step graph.

    Every rank generates (tensor-parallel ranks generate together), also one left without a
    prompt when there are fewer prompts than ranks; its empty batch is not scored."""
    refs = []
    for rank, part in enumerate(shards(prompts, stages.workers)):
        request = RolloutRequest(part, step, greedy, samples)
        batch = stages.worker(stages.generator, rank).run.remote(stages.generator, "generate", request)
        refs.append(stages.worker("reward", rank).run.remote("reward", "score", batch) if part else batch)
    return ray.get(refs, timeout=stages.timeout)


def validate(stages: Stages, prompts: list[Prompt], step: int, k: int) -> dict[str, float]:
    """Held-out scores per data_source and overall: greedy, and with k > 0 mean@k and pass@j (j = 2, 4 .. k).

    A sample passes when it scores >= 1, a rule reward's full marks.
    """
    out = prompt_means(rollout(stages, prompts, step, greedy=True), {"greedy_score": lambda s: s[0]})
    if k:
        stats: dict[str, Callable[[list[float]], float]] = {f"mean_at_{k}": lambda s: sum(s) / len(s)}
        for j in sorted({2 ** i for i in range(1, k.bit_length())} | {k} - {1}):
            stats[f"pass_at_{j}"] = partial(passed, j)
        out.update(prompt_means(rollout(stages, prompts, step, samples=k), stats))
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


def step_inputs(stages: Stages, loader: PromptLoader, step: int, tries: int,
                mini_prompts: int) -> tuple[list[Any], dict[str, float]]:
    """What the step graph starts from, per rank, and driver-side metrics: RolloutRequests, or with
    tries > 0 (DAPO's dynamic sampling) the scored batches `dynamic_sample` kept."""
    if not tries:
        return [RolloutRequest(s, step) for s in shards(loader.next_batch(), stages.workers)], {}
    kept, metrics = dynamic_sample(stages, loader, step, tries)
    return balanced_shards(kept, stages.workers, mini_prompts), metrics


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
        scored = rollout(stages, loader.next_batch(), step)
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


def merge(results: list[dict], seconds: float, workers: int, driver: dict[str, float]) -> dict[str, float]:
    """Mean of each rank's metrics, the driver's own, plus step timing and throughput."""
    metrics = {k: sum(r["metrics"][k] for r in results) / len(results) for k in results[0]["metrics"]}
    metrics.update(driver)
    for k in results[0]["timing"]:
        metrics[f"timing_s/{k}"] = max(r["timing"][k] for r in results)
    metrics["timing_s/step"] = seconds
    tokens = sum(r["metrics"]["perf/total_num_tokens"] for r in results)
    metrics["perf/total_num_tokens"] = tokens
    metrics["perf/throughput"] = tokens / seconds / workers
    return metrics


TRAINED = ("actor", "critic")  # the roles whose state a checkpoint holds, where they exist


def save(stages: Stages, root: Path, step: int, loader: PromptLoader, run_id: str, keep: int) -> Path:
    tmp = checkpoint.begin(root, step)
    ray.get([stages.worker(role, r).run.remote(role, "save", str(tmp))
             for role in TRAINED if role in stages.roles for r in range(stages.workers)])
    return checkpoint.commit(root, tmp, step, {"step": step, "loader": loader.state_dict(), "run_id": run_id},
                             keep)


# A stage's process died (OOM kill, node loss, segfault), or a wait on the workers ran past
# trainer.step_timeout_s (a stuck kernel or collective): rebuild the workers and continue.
WORKER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.RayChannelError,
               ray.exceptions.GetTimeoutError)


class Workers:
    """Live stages restored to a checkpoint (or fresh), and the step runner over them."""

    def __init__(self, cfg: Config, model_path: str, ckpt: Path | None, loader: PromptLoader) -> None:
        self.stages = Stages(cfg, model_path)
        self.start = 0
        loader.load_state_dict({"epoch": 0, "position": 0, "seed": cfg.trainer.seed})
        if ckpt:
            ray.get([self.stages.worker(role, r).run.remote(role, "load", str(ckpt))
                     for role in TRAINED if role in self.stages.roles for r in range(self.stages.workers)])
            self.stages.push_weights()  # split placement: the rollout pool still holds the initial weights
            state = checkpoint.read_driver_state(ckpt)
            loader.load_state_dict(state["loader"])
            self.start = state["step"]
            print(f"resumed from {ckpt} at step {self.start}")
        self.run_step, self._release = make_runner(cfg, self.stages)

    def close(self) -> None:
        for stop in (self._release, self.stages.shutdown):
            try:
                stop()
            except Exception as e:  # a dead worker may fail its own teardown; the rest must still go
                print(f"rlflow: ignoring {type(e).__name__} while stopping workers: {e}")


def train(cfg: Config, model_path: str, files: dict[str, list[str]], tracker: Tracker) -> Path:
    """The RL loop; returns the exported HF directory of the final policy."""
    t, out = cfg.trainer, Path(cfg.trainer.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_prompts, counts = load_prompts(files["train"], tokenizer, cfg.data.max_prompt_tokens,
                                         cfg.data.overlong_prompts)
    val_prompts, _ = load_prompts(files["val"], tokenizer, cfg.data.max_prompt_tokens, cfg.data.overlong_prompts)
    val_prompts = val_prompts[:cfg.data.val_max_prompts or None]
    tracker.log_metrics({f"data/{k}": v for k, v in counts.items()}, step=0)
    loader = PromptLoader(train_prompts, cfg.data.prompts_per_step, t.seed)
    root = out / "checkpoints"
    last_ckpt = checkpoint.find_resume(root, t.resume)
    live = Workers(cfg, model_path, last_ckpt, loader)
    step, restarts = live.start, 0
    bar = progress(t.progress, step, t.total_steps)

    def validated(at: int) -> dict[str, float]:
        """Held-out scores at step `at`, logged and their greedy score printed."""
        scores = validate(live.stages, val_prompts, at, t.val_samples)
        tracker.log_metrics(scores, step=at)
        bar.write(f"validation at step {at}: greedy score {scores['val/greedy_score']:.4f}")
        return scores

    try:
        while step < t.total_steps:
            try:
                if t.val_every and step % t.val_every == 0:  # before `begin`: not part of the step's throughput
                    validated(step)
                begin = time.perf_counter()
                # Driver-side: dynamic sampling, when on, generates and filters here.
                inputs, driver_metrics = step_inputs(live.stages, loader, step, cfg.algorithm.dynamic_sampling_tries,
                                                     cfg.actor.mini_batch_prompts)
                results = live.run_step(inputs)
            except WORKER_LOST as e:
                if restarts >= t.max_restarts:
                    raise
                restarts += 1
                what = f"ran past trainer.step_timeout_s={t.step_timeout_s:g}" if isinstance(e, TimeoutError) \
                    else "died"
                print(f"rlflow: a worker {what} at step {step} ({type(e).__name__}); restart {restarts}/"
                      f"{t.max_restarts} from {last_ckpt or 'the initial model'}")
                tracker.log_metrics({"trainer/restarts": restarts}, step=step)
                tracker.set_tags({f"restart.{restarts}": f"step {step}: {type(e).__name__}: {e}"[:500]})
                live.close()
                live = Workers(cfg, model_path, last_ckpt, loader)
                step = live.start
                continue
            metrics = merge(results, time.perf_counter() - begin, live.stages.workers, driver_metrics)
            check_health(metrics, t.max_consecutive_skips, last_ckpt)
            step += 1
            tracker.log_metrics(metrics, step=step)
            if t.samples_every and step % t.samples_every == 0:
                tracker.log_table([dict(s, step=step) for r in results for s in r["samples"]],
                                  f"samples/step_{step:06d}.json")
            if t.save_every and step % t.save_every == 0 and step < t.total_steps:
                last_ckpt = save(live.stages, root, step, loader, tracker.run_id, t.keep_last)
            bar.update(metrics)
        bar.close(validated(t.total_steps))
        ckpt = save(live.stages, root, t.total_steps, loader, tracker.run_id, t.keep_last)
        if t.log_checkpoint:
            tracker.log_artifact(str(ckpt), f"checkpoints/{ckpt.name}")
        export = out / "hf_model"
        ray.get([live.stages.worker("actor", r).run.remote("actor", "export", str(export))  # collective
                 for r in range(live.stages.workers)])
        tracker.log_artifact(str(export), "hf_model")
        return export
    finally:
        live.close()


def check_health(metrics: dict[str, float], limit: int, last_ckpt: Path | None) -> None:
    """Stop when the optimizer keeps refusing non-finite updates; the weights never took them."""
    if limit and metrics["actor/consecutive_skipped_steps"] >= limit:
        raise RuntimeError(
            f"{int(metrics['actor/consecutive_skipped_steps'])} optimizer steps in a row had a non-finite loss "
            f"or gradient (trainer.max_consecutive_skips={limit}); stopping. The last checkpoint is intact: "
            f"{last_ckpt or 'none was written yet'}")


class progress:
    """A one-line tqdm bar: step, reward, throughput, ETA."""

    def __init__(self, enabled: bool, start: int, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True)

    def write(self, line: str) -> None:
        """A line above the bar (printed as is when the bar is off)."""
        if self.bar.disable:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def update(self, m: dict[str, float]) -> None:
        self.bar.set_postfix(reward=f"{m['critic/score/mean']:.3f}", tok_s=f"{m['perf/throughput']:.0f}")
        self.bar.update(1)

    def close(self, final: dict[str, float]) -> None:
        self.bar.close()
