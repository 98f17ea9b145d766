"""GRPO (and its group-baseline relatives) from prompts to gradients, on Ray, tracked in MLflow.

Algorithm: for each prompt sample G responses; score them with rule rewards; the advantage of a
response is its reward minus the group mean, over the group std (`algorithm.advantage` swaps in
Dr.GRPO, RLOO, REINFORCE++); update the policy with the PPO-clip loss (optionally with a k3 KL
loss to the frozen reference). No critic, no value function, no reward model in this file.

One step, per data-parallel rank (`step_graph`):
    generate -> score -> [reference logprobs] -> old logprobs -> advantages -> update
The same graph is either compiled once into a Ray compiled DAG (`trainer.dag=compiled`) or run
as chained `.remote()` calls (`plain`); both execute the same stage verbs in the same order, so a
seed gives identical metrics. Validation, checkpoints and logging stay in the driver, between
executions.

Run: `rlflow train [conf/x.yaml] [key=value ...]`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from transformers import AutoTokenizer

from engine import checkpoint
from engine.batch import RolloutRequest
from engine.config import Config
from engine.data import Prompt, PromptLoader, load_prompts
from engine.placement import Pool
from engine.tracking import Tracker
from stages.actor import ActorRollout
from stages.reference import Reference
from stages.reward import Reward
from stages.worker import StageWorker

GET_TIMEOUT_S = 3600.0  # a step may legitimately run long; ray.get's compiled-graph default is 10 s


class Stages:
    """Worker pools and which pool serves each role (actor, reward, reference)."""

    def __init__(self, cfg: Config, model_path: str) -> None:
        p = cfg.placement
        device = "cuda" if p.gpus_per_worker else "cpu"
        roles: dict[str, tuple[type, Callable[[int], dict]]] = {
            "actor": (ActorRollout, lambda r: dict(cfg=cfg, model_path=model_path, rank=r, world=p.workers,
                                                  device=device)),
            "reward": (Reward, lambda r: dict(cfg=cfg)),
        }
        if cfg.actor.kl_loss_coef or cfg.algorithm.kl_in_reward:
            roles["reference"] = (Reference, lambda r: dict(cfg=cfg, model_path=model_path, device=device))
        self.pools: dict[str, Pool] = {}
        self.roles: dict[str, str] = {}
        for role, (cls, kwargs) in roles.items():
            where = role if role in p.own_pool else "hybrid"
            if where not in self.pools:  # rule rewards need no GPU
                gpus = 0.0 if where == "reward" else p.gpus_per_worker
                self.pools[where] = Pool(where, StageWorker, p.workers, gpus, p.torch_threads)
            self.pools[where].add(role, cls, kwargs)
            self.roles[role] = where
        self.workers = p.workers

    def worker(self, role: str, rank: int) -> Any:
        return self.pools[self.roles[role]].workers[rank]

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()


def step_graph(stages: Stages, requests: list[Any], call: Callable) -> list[Any]:
    """The step's dataflow, one chain per rank; `call` binds (compiled DAG) or submits (plain)."""
    outputs = []
    for rank, request in enumerate(requests):
        def at(role: str, verb: str, x: Any, rank: int = rank) -> Any:
            return call(stages.worker(role, rank).run, role, verb, x)
        batch = at("actor", "generate", request)  # G samples per prompt, with rollout logprobs
        batch = at("reward", "score", batch)  # rule reward per response
        if "reference" in stages.roles:
            batch = at("reference", "logprobs", batch)  # anchor for the KL loss
        batch = at("actor", "logprobs", batch)  # old-policy logprobs for the PPO ratio
        batch = at("actor", "advantages", batch)  # group-relative advantages
        outputs.append(at("actor", "update", batch))  # PPO-clip epochs over mini-batches
    return outputs


def make_runner(cfg: Config, stages: Stages) -> tuple[Callable[[list[RolloutRequest]], list[dict]], Callable]:
    """(run one step, release) for the configured execution mode."""
    if cfg.trainer.dag == "plain":
        submit = lambda method, *args: method.remote(*args)  # noqa: E731
        return (lambda reqs: ray.get(step_graph(stages, reqs, submit), timeout=GET_TIMEOUT_S)), (lambda: None)
    from ray.dag import InputNode, MultiOutputNode

    bind = lambda method, *args: method.bind(*args)  # noqa: E731
    with InputNode() as inp:
        dag = MultiOutputNode(step_graph(stages, [inp[r] for r in range(stages.workers)], bind))
    compiled = dag.experimental_compile(_submit_timeout=GET_TIMEOUT_S)
    return (lambda reqs: ray.get(compiled.execute(*reqs), timeout=GET_TIMEOUT_S)), compiled.teardown


def shards(prompts: list[Prompt], n: int) -> list[list[Prompt]]:
    """Contiguous equal shards, so every prompt's group stays on one rank."""
    size = len(prompts) // n
    return [prompts[i * size:(i + 1) * size] for i in range(n)]


def validate(stages: Stages, prompts: list[Prompt], step: int) -> dict[str, float]:
    """Greedy decoding on held-out prompts; mean score per data_source and overall."""
    refs = []
    for rank, part in enumerate(shards(prompts, stages.workers)):
        batch = stages.worker("actor", rank).run.remote("actor", "generate", RolloutRequest(part, step, True))
        refs.append(stages.worker("reward", rank).run.remote("reward", "score", batch))
    sums: dict[str, list[float]] = {}
    for batch in ray.get(refs, timeout=GET_TIMEOUT_S):
        for source, score in zip(batch.data_source, batch.scores.tolist()):
            sums.setdefault(source, []).append(score)
    out = {f"val/{s}/greedy_score": sum(v) / len(v) for s, v in sums.items()}
    out["val/greedy_score"] = sum(sum(v) for v in sums.values()) / sum(len(v) for v in sums.values())
    return out


def merge(results: list[dict], seconds: float, workers: int) -> dict[str, float]:
    """Mean of each rank's metrics, plus step timing and throughput."""
    metrics = {k: sum(r["metrics"][k] for r in results) / len(results) for k in results[0]["metrics"]}
    for k in results[0]["timing"]:
        metrics[f"timing_s/{k}"] = max(r["timing"][k] for r in results)
    metrics["timing_s/step"] = seconds
    tokens = sum(r["metrics"]["perf/total_num_tokens"] for r in results)
    metrics["perf/total_num_tokens"] = tokens
    metrics["perf/throughput"] = tokens / seconds / workers
    return metrics


def save(stages: Stages, root: Path, step: int, loader: PromptLoader, run_id: str, keep: int) -> Path:
    tmp = checkpoint.begin(root, step)
    ray.get([stages.worker("actor", r).run.remote("actor", "save", str(tmp)) for r in range(stages.workers)])
    return checkpoint.commit(root, tmp, step, {"step": step, "loader": loader.state_dict(), "run_id": run_id},
                             keep)


# A stage's process died (OOM kill, node loss, segfault): rebuild the workers and continue.
WORKER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.RayChannelError)


class Workers:
    """Live stages restored to a checkpoint (or fresh), and the step runner over them."""

    def __init__(self, cfg: Config, model_path: str, ckpt: Path | None, loader: PromptLoader) -> None:
        self.stages = Stages(cfg, model_path)
        self.start = 0
        loader.load_state_dict({"epoch": 0, "position": 0, "seed": cfg.trainer.seed})
        if ckpt:
            ray.get([self.stages.worker("actor", r).run.remote("actor", "load", str(ckpt))
                     for r in range(self.stages.workers)])
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
    val_prompts = val_prompts[:len(val_prompts) // cfg.placement.workers * cfg.placement.workers]
    tracker.log_metrics({f"data/{k}": v for k, v in counts.items()}, step=0)
    loader = PromptLoader(train_prompts, cfg.data.prompts_per_step, t.seed)
    root = out / "checkpoints"
    last_ckpt = checkpoint.find_resume(root, t.resume)
    live = Workers(cfg, model_path, last_ckpt, loader)
    step, restarts = live.start, 0
    bar = progress(t.progress, step, t.total_steps)
    try:
        while step < t.total_steps:
            try:
                if t.val_every and step % t.val_every == 0:
                    tracker.log_metrics(validate(live.stages, val_prompts, step), step=step)
                begin = time.perf_counter()
                requests = [RolloutRequest(s, step) for s in shards(loader.next_batch(), live.stages.workers)]
                results = live.run_step(requests)
            except WORKER_LOST as e:
                if restarts >= t.max_restarts:
                    raise
                restarts += 1
                print(f"rlflow: a worker died at step {step} ({type(e).__name__}); restart {restarts}/"
                      f"{t.max_restarts} from {last_ckpt or 'the initial model'}")
                tracker.log_metrics({"trainer/restarts": restarts}, step=step)
                tracker.set_tags({f"restart.{restarts}": f"step {step}: {type(e).__name__}: {e}"[:500]})
                live.close()
                live = Workers(cfg, model_path, last_ckpt, loader)
                step = live.start
                continue
            metrics = merge(results, time.perf_counter() - begin, live.stages.workers)
            check_health(metrics, t.max_consecutive_skips, last_ckpt)
            step += 1
            tracker.log_metrics(metrics, step=step)
            if t.samples_every and step % t.samples_every == 0:
                tracker.log_table([dict(s, step=step) for r in results for s in r["samples"]],
                                  f"samples/step_{step:06d}.json")
            if t.save_every and step % t.save_every == 0 and step < t.total_steps:
                last_ckpt = save(live.stages, root, step, loader, tracker.run_id, t.keep_last)
            bar.update(metrics)
        final = validate(live.stages, val_prompts, t.total_steps)
        tracker.log_metrics(final, step=t.total_steps)
        bar.close(final)
        ckpt = save(live.stages, root, t.total_steps, loader, tracker.run_id, t.keep_last)
        tracker.log_artifact(str(ckpt), f"checkpoints/{ckpt.name}")
        export = out / "hf_model"
        ray.get(live.stages.worker("actor", 0).run.remote("actor", "export", str(export)))
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

    def update(self, m: dict[str, float]) -> None:
        self.bar.set_postfix(reward=f"{m['critic/score/mean']:.3f}", tok_s=f"{m['perf/throughput']:.0f}")
        self.bar.update(1)

    def close(self, final: dict[str, float]) -> None:
        self.bar.close()
