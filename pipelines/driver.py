"""The one driver loop of every training pipeline (GRPO and its relatives, PPO, SFT, DPO).

An algorithm is its stages, its step graph and how it reads the step's outputs (`Algorithm`);
this loop owns everything else:
    resume -> [validate] -> step inputs -> run the step graph -> metrics -> log -> [checkpoint]
    ... -> final validation, checkpoint and HF export
A worker that dies, or stops moving for `trainer.stall_timeout_s`, in a step or a validation, has the
workers rebuilt from the last complete checkpoint (or the initial model) and the loop goes on,
up to `trainer.max_restarts` times. A first SIGINT (Ctrl-C) or SIGTERM stops the loop once the
step running ends, with a checkpoint of it (`Stopped`); a second SIGINT stops at once.

Invariants:
- a resumed run continues from the checkpoint's weights, optimizer, loader position and step,
  so it logs the same numbers as a run never stopped;
- `save`, `load` and `export` are collective: every rank of a stage is called together.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from rlflow.engine import checkpoint
from rlflow.engine.config import Config, to_dict
from rlflow.engine.data.prompts import PromptLoader
from rlflow.engine.tracking import Tracker
from rlflow.pipelines import hangs
from rlflow.pipelines.runtime import WORKER_LOST, Runner, Stages, how_lost
from rlflow.stages.policy import Policy


class Algorithm(Protocol):
    """What the loop needs of an algorithm."""

    def graph(self, stages: Stages, inputs: list[Any]) -> tuple[list[Any], list[Any]]:
        """The step's dataflow over the stages (see runtime.Graph)."""
        ...

    def launch(self) -> Stages:
        """Start the workers and build the stages (fresh weights: the model directory's)."""
        ...

    def inputs(self, stages: Stages, loader: PromptLoader, step: int) -> tuple[list[Any], dict[str, float]]:
        """Each rank's input to the step graph, and metrics the driver computed making them."""
        ...

    def after_step(self, stages: Stages, outputs: list[Any]) -> None:
        """Work of the step outside its graph, after it (RL generating ahead: the weight push)."""
        ...

    def metrics(self, outputs: list[Any], seconds: float) -> dict[str, float]:
        """The step's metrics from each rank's output and the step's wall time."""
        ...

    def samples(self, outputs: list[Any]) -> list[dict]:
        """A few generated samples for the samples table (none where nothing is generated)."""
        ...

    def validate(self, stages: Stages, step: int) -> dict[str, float]:
        """Held-out metrics (`val/*`) of the current policy."""
        ...

    def headline(self, metrics: dict[str, float], validation: bool) -> str:
        """One short line of a step's (or a validation's) main numbers, for the terminal."""
        ...


class Workers:
    """Live stages restored to a checkpoint (or fresh), and the step runner over them."""

    def __init__(self, cfg: Config, algo: Algorithm, ckpt: Path | None, loader: PromptLoader) -> None:
        self.stages = algo.launch()
        self.start = 0
        loader.load_state_dict({"epoch": 0, "position": 0, "seed": cfg.trainer.seed})
        if ckpt:
            self.stages.load(str(ckpt))
            state = checkpoint.read_driver_state(ckpt)
            loader.load_state_dict(state["loader"])
            self.start = state["step"]
            print(f"resumed from {ckpt} at step {self.start}")
        self.run = Runner(self.stages, algo.graph, cfg.trainer.dag)

    def close(self, lost: bool = False) -> None:
        """Stop the runner and the workers; `lost`: one of them died or hangs, so the workers are
        killed first: a compiled graph's teardown waits on each live worker's loop (Ray allows a
        stopped one 30 s to cancel, then 30 s more to exit), a killed one it skips at once."""
        runner = functools.partial(self.run.close, lost)
        for stop in (self.stages.shutdown, runner) if lost else (runner, self.stages.shutdown):
            try:
                stop()
            except Exception as e:  # a dead worker may fail its own teardown; the rest must still go
                print(f"rlflow: ignoring {type(e).__name__} while stopping workers: {e}")


class Stopped(Exception):
    """The run stopped on a signal after step `step`, saved in `checkpoint`."""

    def __init__(self, signum: int, step: int, ckpt: Path) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {ckpt}")
        self.signum, self.step, self.checkpoint = signum, step, ckpt


class StopRequests:
    """From its making (on the main thread) to `restore`, the first SIGINT or SIGTERM is noted in
    `signum`, for the loop to stop once the step running ends; a second SIGINT raises
    KeyboardInterrupt at once. Ray's own processes block SIGINT: a terminal's Ctrl-C reaches the
    driver only."""

    def __init__(self) -> None:
        self.signum = 0
        self.before: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self.before = {s: signal.signal(s, self._note) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for s, handler in self.before.items():
            signal.signal(s, handler)
        self.before = {}

    def _note(self, signum: int, _frame: object) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        again = " (Ctrl-C again stops at once, losing the step)" if signum == signal.SIGINT else ""
        print(f"\nrlflow: {signal.Signals(signum).name}: stopping once this step ends, with a checkpoint{again}",
              flush=True)


def save(cfg: Config, stages: Stages, step: int, loader: PromptLoader, run_id: str) -> Path:
    """A checkpoint of step `step`; its driver state also holds the run's resolved config."""
    root = Path(cfg.trainer.output_dir) / "checkpoints"
    tmp = checkpoint.begin(root, step)
    stages.save(str(tmp))
    state = {"step": step, "loader": loader.state_dict(), "run_id": run_id, "config": to_dict(cfg)}
    return checkpoint.commit(root, tmp, step, state, cfg.trainer.keep_last)


def run(cfg: Config, algo: Algorithm, loader: PromptLoader, tracker: Tracker) -> Path:
    """The loop; returns the exported HF directory of the final policy."""
    t, out = cfg.trainer, Path(cfg.trainer.output_dir)
    root = out / "checkpoints"
    last_ckpt = checkpoint.find_resume(root, t.resume)
    live = Workers(cfg, algo, last_ckpt, loader)
    step, restarts = live.start, 0
    bar = Progress(sys.stderr.isatty(), step, t.total_steps)  # a log file gets lines, not a bar

    def validated(at: int) -> None:
        """Held-out metrics at step `at`, logged, and their headline printed."""
        scores = algo.validate(live.stages, at)
        tracker.log_metrics(scores, step=at)
        bar.write(f"validation at step {at}: {algo.headline(scores, validation=True)}")

    def advance(at: int) -> int:
        """Step `at` -> at + 1: [validation], the step graph, its metrics and logs, [a checkpoint]."""
        nonlocal last_ckpt
        if t.val_every and at % t.val_every == 0:  # before `begin`: not part of the step's throughput
            validated(at)
        begin = time.perf_counter()
        inputs, driver_metrics = algo.inputs(live.stages, loader, at)  # e.g. DAPO's dynamic sampling
        outputs = live.run(inputs)
        algo.after_step(live.stages, outputs)
        metrics = {**algo.metrics(outputs, time.perf_counter() - begin), **driver_metrics}
        check_health(metrics, last_ckpt)
        at += 1
        tracker.log_metrics(metrics, step=at)
        if (at == t.total_steps or (t.val_every and at % t.val_every == 0)) and (rows := algo.samples(outputs)):
            tracker.log_table([dict(s, step=at) for s in rows], f"samples/step_{at:06d}.json")
        if t.save_every and at % t.save_every == 0 and at < t.total_steps:
            last_ckpt = save(cfg, live.stages, at, loader, tracker.run_id)
        bar.update(algo.headline(metrics, validation=False))
        return at

    healthy = False  # every worker alive and idle at the end: stopped gracefully, not killed
    stop = StopRequests()
    dog = hangs.Watchdog(t.stall_timeout_s, out / "hang", tracker)
    try:
        while step < t.total_steps and not stop.signum:
            try:
                with dog.watching(live.stages.pools, live.stages.groups(), f"step_{step:06d}"):
                    step = advance(step)
            except WORKER_LOST as e:  # in the step, a validation or a checkpoint's save
                why = hangs.lost(how_lost(e), live.stages.pools, live.stages.groups(),
                                 out / "hang" / f"step_{step:06d}", tracker)
                print(f"rlflow: a worker {why} at step {step} ({type(e).__name__})")
                if restarts >= t.max_restarts:
                    raise
                restarts += 1
                print(f"rlflow: restart {restarts}/{t.max_restarts} from {last_ckpt or 'the initial model'}")
                tracker.log_metrics({"trainer/restarts": restarts}, step=step, again=True)
                tracker.set_tags({f"restart.{restarts}": f"step {step}: {type(e).__name__}: {e}"[:500]})
                live.close(lost=True)
                live = Workers(cfg, algo, last_ckpt, loader)
                step = live.start
        if stop.signum and step < t.total_steps:  # stopped early: the last step saved, if it is not yet
            if last_ckpt != checkpoint.step_dir(root, step):
                last_ckpt = save(cfg, live.stages, step, loader, tracker.run_id)
            healthy = True
            bar.close()
            raise Stopped(stop.signum, step, last_ckpt)
        stop.restore()
        with dog.watching(live.stages.pools, live.stages.groups(), "final"):
            validated(t.total_steps)
            bar.close()
            ckpt = save(cfg, live.stages, t.total_steps, loader, tracker.run_id)
            export = out / "hf_model"
            live.stages.policy.all(Policy.export, str(export))
        if t.log_checkpoint:
            tracker.log_artifact(str(ckpt), f"checkpoints/{ckpt.name}")
        tracker.log_artifact(str(export), "hf_model")
        healthy = True
        return export
    finally:
        stop.restore()
        live.close(lost=not healthy)  # after an error a worker may hang: kill, do not wait for it


# A run whose optimizer refuses this many updates in a row has diverged (or its data or reward is
# broken): going on burns GPU hours with weights that never move. One or two in a row do happen.
MAX_CONSECUTIVE_SKIPS = 5


def check_health(metrics: dict[str, float], last_ckpt: Path | None) -> None:
    """Stop when the optimizer keeps refusing non-finite updates; the weights never took them."""
    if metrics["actor/consecutive_skipped_steps"] >= MAX_CONSECUTIVE_SKIPS:
        raise RuntimeError(
            f"{int(metrics['actor/consecutive_skipped_steps'])} optimizer steps in a row had a non-finite loss "
            f"or gradient; stopping. The last checkpoint is intact: "
            f"{last_ckpt or 'none was written yet'}")


def even_cut(items: list, workers: int, what: str) -> tuple[list, int]:
    """The first multiple of `workers` of `items`, so every rank scores as many, and how many were
    left out (said on stdout)."""
    left_out = len(items) % workers
    if left_out:
        print(f"rlflow: {what}: {left_out} of {len(items)} left out, so that each of {workers} ranks gets as many")
    return items[:len(items) - left_out], left_out


class Progress:
    """A one-line tqdm bar: step, the algorithm's headline, ETA."""

    def __init__(self, enabled: bool, start: int, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True)

    def write(self, line: str) -> None:
        """A line above the bar (printed as is when the bar is off)."""
        if self.bar.disable:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def update(self, headline: str) -> None:
        self.bar.set_postfix_str(headline)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
