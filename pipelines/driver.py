"""Driver of the pipelines that train on fixed data (DPO, SFT): the worker pools, the step runner
(a Ray compiled graph or plain `.remote()` calls), the step loop, checkpoints and the final export.

Invariants:
- the actor's `save`, `load` and `export` are collective: every rank is called, together;
- a resumed run continues from the checkpoint's weights, optimizer and loader position.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from engine import checkpoint
from engine.config import Config
from engine.data.prompts import PromptLoader
from engine.placement import Pool
from engine.tracking import Tracker
from stages.actor import ActorRollout
from stages.reference import Reference
from stages.worker import StageWorker


class Stages:
    """The policy (actor) and, if asked, the frozen reference, colocated unless `placement.own_pool`
    has reference. For the pipelines that never sample (SFT, DPO, the warm start): the actors build
    no rollout engine."""

    def __init__(self, cfg: Config, model_path: str, reference: bool) -> None:
        p = cfg.placement
        device = "cuda" if p.gpus_per_worker else "cpu"
        self.roles = {"actor": "hybrid"}
        if reference:
            self.roles["reference"] = "reference" if "reference" in p.own_pool else "hybrid"
        self.pools = {name: Pool(name, StageWorker, p.workers, p.gpus_per_worker, p.torch_threads)
                      for name in dict.fromkeys(self.roles.values())}
        self.pools["hybrid"].add("actor", ActorRollout, lambda r: dict(cfg=cfg, model_path=model_path, rank=r,
                                                                      world=p.workers, device=device,
                                                                      generates=False))
        if reference:
            self.pools[self.roles["reference"]].add("reference", Reference,
                                                    lambda r: dict(cfg=cfg, model_path=model_path, device=device))
        self.workers = p.workers
        self.timeout = cfg.trainer.step_timeout_s  # every wait on the workers

    def worker(self, role: str, rank: int) -> Any:
        return self.pools[self.roles[role]].workers[rank]

    def actors(self, verb: str, *args: Any) -> list:
        """`verb` on every rank's actor, together (the collective verbs); their results."""
        return ray.get([self.worker("actor", r).run.remote("actor", verb, *args) for r in range(self.workers)],
                       timeout=self.timeout)

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()


Graph = Callable[[Stages, list[Any], Callable], list[Any]]  # (stages, per-rank inputs, bind or submit) -> outputs


def make_runner(cfg: Config, stages: Stages, graph: Graph) -> tuple[Callable[[list[Any]], list[dict]], Callable]:
    """(run one step, release) for the configured execution mode."""
    if cfg.trainer.dag == "plain":
        submit = lambda method, *args: method.remote(*args)  # noqa: E731
        return (lambda xs: ray.get(graph(stages, xs, submit), timeout=stages.timeout)), (lambda: None)
    from ray.dag import InputNode, MultiOutputNode

    bind = lambda method, *args: method.bind(*args)  # noqa: E731
    with InputNode() as inp:
        dag = MultiOutputNode(graph(stages, [inp[r] for r in range(stages.workers)], bind))
    compiled = dag.experimental_compile(_submit_timeout=stages.timeout)
    return (lambda xs: ray.get(compiled.execute(*xs), timeout=stages.timeout)), compiled.teardown


def even_cut(items: list, workers: int, what: str) -> tuple[list, int]:
    """The first multiple of `workers` of `items`, so every rank scores as many, and how many were
    left out (said on stdout)."""
    left_out = len(items) % workers
    if left_out:
        print(f"rlflow: {what}: {left_out} of {len(items)} left out, so that each of {workers} ranks gets as many")
    return items[:len(items) - left_out], left_out


def save(stages: Stages, root: Path, step: int, loader: PromptLoader, run_id: str, keep: int) -> Path:
    tmp = checkpoint.begin(root, step)
    stages.actors("save", str(tmp))
    return checkpoint.commit(root, tmp, step, {"step": step, "loader": loader.state_dict(), "run_id": run_id},
                             keep)


def resume(stages: Stages, ckpt: Path | None, loader: PromptLoader) -> int:
    """Load `ckpt` (if any) into the actors and the loader; returns the step to continue from."""
    if not ckpt:
        return 0
    stages.actors("load", str(ckpt))
    state = checkpoint.read_driver_state(ckpt)
    loader.load_state_dict(state["loader"])
    print(f"resumed from {ckpt} at step {state['step']}")
    return int(state["step"])


def finish(stages: Stages, root: Path, step: int, loader: PromptLoader, tracker: Tracker, keep: int,
           log_checkpoint: bool = True) -> Path:
    """The final checkpoint and `<output_dir>/hf_model`, both logged as artifacts (the checkpoint
    unless `log_checkpoint` is false); returns the export."""
    ckpt = save(stages, root, step, loader, tracker.run_id, keep)
    if log_checkpoint:
        tracker.log_artifact(str(ckpt), f"checkpoints/{ckpt.name}")
    export = root.parent / "hf_model"
    stages.actors("export", str(export))
    tracker.log_artifact(str(export), "hf_model")
    return export


def run(cfg: Config, stages: Stages, graph: Graph, loader: PromptLoader, tracker: Tracker,
        step: Callable[[Callable, list], dict[str, float]], validate: Callable[[], dict[str, float]],
        progress: Callable[[dict[str, float]], str]) -> Path:
    """The loop: resume, then `step(run_step, next batch)` until trainer.total_steps, validating
    every trainer.val_every steps (outside the step's time), checkpointing every save_every; ends
    with a validation, the final checkpoint and the export, which it returns."""
    t, root = cfg.trainer, Path(cfg.trainer.output_dir) / "checkpoints"
    from pipelines.grpo import check_health

    release: Callable = lambda: None  # noqa: E731
    try:
        last_ckpt = checkpoint.find_resume(root, t.resume)
        done = resume(stages, last_ckpt, loader)
        run_step, release = make_runner(cfg, stages, graph)
        while done < t.total_steps:
            if t.val_every and done % t.val_every == 0:
                tracker.log_metrics(validate(), step=done)
            metrics = step(run_step, loader.next_batch())
            check_health(metrics, t.max_consecutive_skips, last_ckpt)
            done += 1
            tracker.log_metrics(metrics, step=done)
            if t.save_every and done % t.save_every == 0 and done < t.total_steps:
                last_ckpt = save(stages, root, done, loader, tracker.run_id, t.keep_last)
            if t.progress and (done % 10 == 0 or done == t.total_steps):
                print(f"{cfg.algorithm.name} step {done}/{t.total_steps}: {progress(metrics)}")
        tracker.log_metrics(validate(), step=t.total_steps)
        return finish(stages, root, t.total_steps, loader, tracker, t.keep_last, t.log_checkpoint)
    finally:
        release()
        stages.shutdown()
