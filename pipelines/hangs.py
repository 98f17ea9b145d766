"""Hangs found by the work done, and explained: what every worker was doing when a step was
lost (a worker died, or stopped moving), read before anything is killed.

`Watchdog` watches a step: when a call runs, or the driver waits on one, and no worker's count
of work done (engine/progress.py) moves for `trainer.stall_timeout_s`, the step is stuck. A wait
in a watched block has no clock of its own (`awaited`): a long step that moves is never stopped.
Where no work can be seen moving (a stage starting: a model load), `answered` waits while the
workers answer instead.

For each worker of each pool, `report` reads the process's Python stacks, every thread, from
outside with py-spy (it needs nothing from the process and reads a stopped one too), on the
worker's own node; where that node has NVIDIA GPUs, it adds what nvidia-smi says they run. It
writes one file per worker and a summary into a directory (the driver logs it as the run's
`hang/step_N` artifact) and returns the summary: per worker, the stage verb it is in, the
innermost frame of rlflow's own code, and the innermost frame of all, which is the wait it is
in or the user's code it runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

# rlflow's own code, as its files resolve (an editable install reaches them through links)
OURS = tuple(str(Path(__file__).resolve().parents[1] / part) + os.sep for part in ("engine", "stages", "pipelines"))
LIBRARIES = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
CALL = ("StageWorker.run", "worker.py")  # the frame a stage verb runs under: the one inside it is the verb


def look(pid: int) -> dict[str, Any]:
    """On the worker's node: its process state, py-spy's threads (innermost frame first) or why
    there are none, and the node's GPUs."""
    state = _state(pid)
    seen: dict[str, Any] = {"state": state or "gone: the process exited", "threads": None, "gpus": _gpus()}
    if state is None:
        return seen
    spy = shutil.which("py-spy", path=os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))))
    if spy is None:
        return {**seen, "why": "py-spy is not installed (ray[default] brings it)"}
    try:
        out = subprocess.run([spy, "dump", "--nonblocking", "--json", "--pid", str(pid)], capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return {**seen, "why": "py-spy ran past 30 s"}
    if out.returncode:
        return {**seen, "why": next(iter((out.stderr or out.stdout).strip().splitlines()),
                                    f"py-spy exited {out.returncode}")}
    return {**seen, "threads": json.loads(out.stdout)}


def _state(pid: int) -> str | None:
    """'running', 'stopped' (SIGSTOP, a debugger), ...; None when no such process is left."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rpartition(")")[2].split()[0]
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "running"
    return {"T": "stopped", "t": "stopped", "Z": None, "X": None, "D": "in uninterruptible I/O"}.get(code, "running")


def _gpus() -> str:
    """What nvidia-smi says each GPU and each process on it is doing; '' without NVIDIA GPUs."""
    if shutil.which("nvidia-smi") is None:
        return ""
    out = []
    for query in (["--query-gpu=index,utilization.gpu,memory.used,memory.total"],
                  ["--query-compute-apps=gpu_uuid,pid,used_memory"]):
        try:
            done = subprocess.run(["nvidia-smi", *query, "--format=csv"], capture_output=True, text=True, timeout=30)
            out.append(done.stdout.strip() or done.stderr.strip())
        except (OSError, subprocess.TimeoutExpired) as e:
            out.append(f"nvidia-smi: {e}")
    return "\n".join(out)


def _where(frame: dict[str, Any]) -> str:
    """`name (file:line)`, rlflow's files by their path in the project."""
    path = str(Path(frame["filename"]).resolve()) if frame["filename"].startswith(os.sep) else frame["filename"]
    for root in OURS:
        if path.startswith(root):
            path = str(Path(root).name / Path(path[len(root):]))
            break
    return f"{frame['name']} ({path}:{frame['line']})"


def _ours(frame: dict[str, Any]) -> bool:
    return frame["filename"].startswith(os.sep) and str(Path(frame["filename"]).resolve()).startswith(OURS)


def _users(frame: dict[str, Any]) -> bool:
    """A frame of the user's own code: a file of neither rlflow nor Python's or an installed library's."""
    name = frame["filename"]
    return name.startswith(os.sep) and not _ours(frame) and not name.startswith(LIBRARIES)


def _is_call(frame: dict[str, Any]) -> bool:
    return (frame["name"], frame["filename"].rpartition(os.sep)[2]) == CALL


def summary(seen: dict[str, Any]) -> str:
    """One worker in a line: the verb it runs > rlflow's innermost frame > the innermost frame."""
    threads = seen["threads"]
    state = "" if seen["state"] == "running" else f"{seen['state']}; "
    if threads is None:
        return f"{seen['state']}" + (f"; no stacks: {seen['why']}" if "why" in seen else "")
    busy = [t for t in threads if any(map(_is_call, t["frames"]))]
    if not busy:
        return f"{state}idle: no stage call running"
    frames = busy[0]["frames"]  # innermost first
    call = next(i for i, f in enumerate(frames) if _is_call(f))
    if not call:
        return f"{state}in StageWorker.run"
    inside = frames[:call - 1]  # below the verb
    steps = [_where(f) for f in (frames[call - 1], next((f for f in inside if _ours(f)), None), frames[0]) if f]
    steps = [s for i, s in enumerate(steps) if s not in steps[:i]]
    # the user's code that one of our threads runs for the call (a reward function's, an environment's)
    helpers = [f"; thread {t['thread_name'] or t['os_thread_id']} in {_where(t['frames'][0])}" for t in threads
               if t is not busy[0] and t["frames"] and _users(t["frames"][0]) and any(map(_ours, t["frames"]))]
    return state + "in " + " > ".join(steps) + "".join(helpers)


def _render(name: str, seen: dict[str, Any]) -> str:
    lines = [f"{name}: {seen['state']}"]
    if seen["threads"] is None:
        lines.append(f"no stacks: {seen.get('why', seen['state'])}")
    for t in seen["threads"] or []:
        lines.append(f"\nThread {t['os_thread_id']} {t['thread_name'] or ''} ({'active' if t['active'] else 'idle'})")
        lines += [f"    {_where(f)}" for f in t["frames"]]
    if seen["gpus"]:
        lines += ["", "nvidia-smi on this node:", seen["gpus"]]
    return "\n".join(lines) + "\n"


def report(pools: Sequence[Any], groups: Sequence[Any], directory: Path) -> list[str]:
    """Every worker of `pools` (each pool's `processes`: the (node, pid) of each rank), named by
    the stages of `groups` it hosts: its stacks written to `directory`, one line each returned."""
    here = ray.get_runtime_context().get_node_id()
    hosts: dict[int, list[str]] = {}
    for group in groups:
        for w in group.workers:
            hosts.setdefault(id(w), []).append(group.key)
    ranks = [(pool.name, rank, w, *where) for pool in pools for rank, (w, where) in
             enumerate(zip(pool.workers, pool.processes))]

    def seen(node: str, pid: int) -> dict[str, Any]:
        if node == here:
            return look(pid)
        far = ray.remote(num_cpus=0)(look).options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        try:
            return ray.get(far.remote(pid), timeout=60)
        except Exception as e:  # the node itself may be what was lost
            return {"state": f"not read: its node did not answer ({type(e).__name__})", "threads": None, "gpus": ""}

    with ThreadPoolExecutor(max(1, len(ranks))) as pool:
        found = list(pool.map(lambda r: seen(r[3], r[4]), ranks))
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for (name, rank, w, _, pid), looked in zip(ranks, found):
        who = f"{name} rank {rank} ({', '.join(sorted(set(hosts.get(id(w), []))))}; pid {pid})"
        lines.append(f"{who}: {summary(looked)}")
        (directory / f"{name}_rank{rank}.txt").write_text(_render(who, looked))
    (directory / "summary.txt").write_text("\n".join(lines) + "\n")
    return lines


def explain(pools: Sequence[Any], groups: Sequence[Any], directory: Path, tracker: Any = None) -> None:
    """`report`, on the terminal and, with a tracker, as the run's `hang/<directory's name>` artifact.
    Never raises: the explanation must not stand in the way of the recovery."""
    try:
        lines = report(pools, groups, directory)
    except Exception as e:
        print(f"rlflow: could not read the workers' stacks: {type(e).__name__}: {e}", flush=True)
        return
    print(f"rlflow: what each worker was doing (stacks in {directory}):", flush=True)
    for line in lines:
        print(f"  {line}", flush=True)
    if tracker is not None:
        tracker.log_artifact(str(directory), f"hang/{directory.name}")


_FIRED: list[str] = []  # why a watchdog stopped a stuck call, until the recovery reads it
_WATCHED = [0]  # watched blocks open now (`Watchdog.watching`)
_AWAITED = [0]  # the driver's waits on the workers in progress (`awaited`)


@contextmanager
def awaited(unwatched_s: float) -> Iterator[float | None]:
    """Around a wait on the workers: gives its time limit, None (no clock) in a watched block,
    whose watchdog ends a wait that stops moving, else `unwatched_s`; and tells the watchdog that
    the driver waits, so a call lost with no worker running it counts as stuck too."""
    _AWAITED[0] += 1
    try:
        yield None if _WATCHED[0] else unwatched_s
    finally:
        _AWAITED[0] -= 1


def answered(refs: list[Any], workers: Sequence[Any], silence_s: float, limit_s: float) -> list[Any]:
    """`ray.get(refs)` for as long as every one of `workers` answers its status (a busy worker's
    second thread does; a stopped or dead one never does), up to `limit_s`: for work that ticks
    no count, such as a stage's start (a model load). GetTimeoutError once a worker has been
    silent for `silence_s`, or `limit_s` has passed."""
    start = heard = time.monotonic()
    every = min(10.0, silence_s / 4)
    while True:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=every)
        if len(ready) == len(refs):
            return ray.get(refs)
        asked = [w.status.remote() for w in workers]
        back, _ = ray.wait(asked, num_returns=len(asked), timeout=every)
        now = time.monotonic()
        heard = now if len(back) == len(asked) else heard
        if now - heard >= silence_s or now - start >= limit_s:
            raise ray.exceptions.GetTimeoutError(
                f"a worker did not answer for {now - heard:.0f} s" if now - heard >= silence_s else
                f"the workers did not finish within {limit_s:g} s")


def lost(otherwise: str, pools: Sequence[Any], groups: Sequence[Any], directory: Path, tracker: Any = None) -> str:
    """Why the workers of a lost call were lost, for the restart line: the watchdog's reason where
    it stopped them (it explained them already), else `otherwise`, once they are explained here."""
    if _FIRED:
        return _FIRED.pop()
    if pools:
        explain(pools, groups, directory, tracker)
    return otherwise


class Watchdog:
    """While `watching`, asks every worker of the pools for its status every few seconds. When a
    call runs, or the driver waits on the workers, and no worker's count of work done
    (engine/progress.py) has moved for `stall_s` (a stopped or dead worker never answers, and so
    never moves), the step is stuck: it explains what each worker was doing (`explain`), then
    kills the workers that run a call or do not answer (all of them, when the driver waits on a
    call none runs), so that the driver's wait fails at once and its recovery goes on; `lost`
    then says why, for the restart line. A long step that moves is never stopped."""

    def __init__(self, stall_s: float, directory: Path, tracker: Any = None) -> None:
        self.stall_s, self.directory, self.tracker = stall_s, directory, tracker
        self.every = min(10.0, stall_s / 4)

    def watching(self, pools: Sequence[Any], groups: Sequence[Any], label: str) -> _Watch:
        return _Watch(self, pools, groups, label)

    def _watch(self, pools: Sequence[Any], groups: Sequence[Any], label: str, stop: threading.Event) -> None:
        workers = [w for pool in pools for w in pool.workers]
        last: list[int | None] = []
        moved = time.monotonic()
        while not stop.wait(self.every):
            try:
                seen = self._ask(workers)
            except Exception:  # Ray shutting down under it: nothing left to watch this time
                continue
            counts = [s[2] if s else None for s in seen]
            busy = [w for w, s in zip(workers, seen) if s is None or s[3] > 0]
            now = time.monotonic()
            if counts != last or not (busy or _AWAITED[0]):  # moving, or the driver's own work
                last, moved = counts, now
            elif now - moved >= self.stall_s and not stop.is_set():
                _FIRED.append(f"made no progress for trainer.stall_timeout_s={self.stall_s:g}")
                print(f"rlflow: no worker moved for trainer.stall_timeout_s={self.stall_s:g} while a call ran",
                      flush=True)
                explain(pools, groups, self.directory / label, self.tracker)
                for w in busy or workers:
                    ray.kill(w)
                return


    def _ask(self, workers: list[Any]) -> list[tuple[str, int, int, int] | None]:
        """Each worker's status, None where it did not answer within one period (stopped, dead)."""
        refs = [w.status.remote() for w in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.every)
        seen: list[tuple[str, int, int, int] | None] = []
        for ref in refs:
            try:
                seen.append(ray.get(ref) if ref in ready else None)
            except Exception:  # a dead worker
                seen.append(None)
        return seen


class _Watch:
    """`with watchdog.watching(pools, groups, label):` the watchdog's thread runs for the block."""

    def __init__(self, dog: Watchdog, pools: Sequence[Any], groups: Sequence[Any], label: str) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=dog._watch, args=(pools, groups, label, self.stop),
                                       name="rlflow-watchdog", daemon=True)

    def __enter__(self) -> None:
        _FIRED.clear()  # a stop the last block's recovery did not need (its call finished meanwhile)
        _WATCHED[0] += 1
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        _WATCHED[0] -= 1
        self.stop.set()
        self.thread.join()
