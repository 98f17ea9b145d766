"""Every pipeline survives a worker that dies (SIGKILL) or hangs (SIGSTOP: a process that never
answers again, as a stuck kernel or collective leaves it): the driver rebuilds the workers from
the last checkpoint (`rlflow eval`: evaluates again) and the job finishes. The real CLI, a real
local Ray cluster, real MLflow. GRPO's cases are in test_e2e.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from test_e2e import BIN, ROOT, env, fault_after_step_2, only_run, stage_workers

from rlflow.engine.data import task

pytestmark = pytest.mark.slow


def command(job: str, tmp_path: Path, model_dir: Path, model_id: str) -> list[str]:
    """A job long enough (many small steps) that a fault lands mid-run, checkpointing every 2 steps.
    SFT's model is a Hub id, resolved offline from a filled HF cache: the rebuilt workers load the
    same snapshot again."""
    common = ["trainer.save_every=2", "trainer.max_restarts=1", "trainer.stall_timeout_s=8", "trainer.val_every=0",
              "data.val_max_prompts=8", f"trainer.output_dir={tmp_path}/out"]
    if job == "eval":  # 256 prompts, a greedy answer and 8 samples each
        val = task.build_data(tmp_path / "data", n_train=8, n_val=256, seed=3)["val"]
        return [str(BIN / "rlflow"), "eval", str(model_dir), f"data.val_files=[{val}]", "rollout.samples_per_prompt=8",
                *common[1:3], f"trainer.output_dir={tmp_path}/out"]
    if job == "sft":
        data = task.build_data(tmp_path / "data", n_train=16, n_val=1, seed=3)["train"]
        return [str(BIN / "rlflow"), "sft", "demo-sft", f"model.path={model_id}", f"data.train_files=[{data}]",
                "data.prompts_per_step=8", "actor.mini_batch_prompts=8", "trainer.total_steps=120", *common]
    data = task.build_pairs(tmp_path / "pairs", n_train=16, n_val=1, seed=3)["train"]
    return [str(BIN / "rlflow"), "dpo", str(ROOT / "conf" / "demo-dpo.yaml"), f"data.train_files=[{data}]",
            "data.prompts_per_step=8", "actor.mini_batch_prompts=8", "warmstart.steps=0", "trainer.total_steps=80",
            *common]


# each job meets one fault, since the driver's recovery is shared (tests/pipelines/test_e2e.py kills
# and hangs RL's workers); eval, which restarts without a training checkpoint, meets both
@pytest.mark.parametrize(("job", "fault"), [("sft", signal.SIGKILL), ("dpo", signal.SIGSTOP), ("eval", signal.SIGKILL),
                                            ("eval", signal.SIGSTOP)], ids=["sft-killed", "dpo-hung", "eval-killed",
                                                                            "eval-hung"])
def test_a_lost_worker_is_rebuilt_and_the_run_finishes(job, fault, tmp_path, model_dir, hub_cache):
    cmd = command(job, tmp_path, model_dir, hub_cache[1])
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache[0])}
    proc = subprocess.Popen(cmd, env={**env(tmp_path), **offline}, cwd=tmp_path, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        marker = tmp_path / "out" / "checkpoints" / "step_000002" / "COMPLETE"
        deadline = time.time() + 300
        workers: list[psutil.Process] = []
        while proc.poll() is None and time.time() < deadline:  # mid-run: past a checkpoint, or evaluating
            workers = stage_workers(proc.pid)
            if workers and (job == "eval" or marker.exists()):
                break
            time.sleep(0.1)
        assert workers, "no stage worker process found"
        for p in workers:
            p.send_signal(fault)
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-3000:]
    # a stopped worker is found by the watchdog (as its pool starts: it does not answer for 8 s)
    what = ("died" if fault == signal.SIGKILL else
            "(made no progress for trainer.stall_timeout_s=8|did not answer in time)")
    assert re.search(f"a worker {what}", output) and "restart 1/1" in output, output[-3000:]
    if job == "eval":  # its fault may land while its workers start, before there is a step to explain
        client, run = only_run(tmp_path)
        assert run.data.metrics["eval/prompts"] == 256 and run.info.status == "FINISHED"
        return
    # what each worker was doing, said before the restart: a killed one is gone, a stopped one's
    # stacks are read all the same
    seen = "gone: the process exited" if fault == signal.SIGKILL else "stopped; "
    assert re.search(rf"^  \w+ rank 0 \([\w, ]+; pid \d+\): {seen}", output, re.MULTILINE), output[-3000:]
    client, run = only_run(tmp_path)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "trainer/restarts")] == [1]
    total = int(next(a for a in cmd if a.startswith("trainer.total_steps=")).split("=")[1])
    key = "sft/loss" if job == "sft" else "dpo/loss"
    assert max(m.step for m in client.get_metric_history(run.info.run_id, key)) == total
    assert run.info.status == "FINISHED" and (tmp_path / "out" / "hf_model" / "config.json").is_file()
    if job == "sft":  # the run names the id, and the commit its workers loaded
        assert (run.data.tags["model"], run.data.tags["model_commit"]) == (hub_cache[1], "a" * 40)


STOPS_BEFORE_A_PUSH = """
import os
import signal
import threading
import time
from pathlib import Path

from rlflow.engine import progress
from rlflow.engine.agents.env import Step

HERE = Path(__file__).parent


def stop_once_idle():
    # once this process's generation is over (no engine step for 0.3 s), stop it: the next call it
    # gets is the trainer's weight push, which then never returns
    last, since = progress.done(), time.time()
    while time.time() - since < 0.3:
        time.sleep(0.02)
        if progress.done() != last:
            last, since = progress.done(), time.time()
    os.kill(os.getpid(), signal.SIGSTOP)


class StopsOnce:
    def __init__(self, prompt):
        self.truth = prompt.ground_truth
        if (HERE / "fault").exists() and not (HERE / "faulted").exists():
            (HERE / "faulted").touch()
            threading.Thread(target=stop_once_idle, daemon=True).start()

    def step(self, response):
        return Step(None, float(response.strip() == self.truth), True)
"""


def test_a_weight_push_that_never_returns_is_explained_and_the_run_finishes(tmp_path):
    """Split placement: the rollout worker stops (as a hung process would) between its generation
    and the trainer's weight push, so the push never returns. The watchdog finds the step stuck,
    names the trainer's rank in the push and the stopped rollout worker, keeps their stacks with
    the run, rebuilds every worker from the last checkpoint, and the run trains every step."""
    (tmp_path / "stops_once.py").write_text(STOPS_BEFORE_A_PUSH)
    args = [str(BIN / "rlflow"), "train", f"trainer.output_dir={tmp_path}/out", "placement.own_pool=[rollout]",
            "trainer.val_every=0", f"rollout.env={tmp_path / 'stops_once.py'}:StopsOnce", "rollout.max_turns=1",
            "rollout.episode_tokens=8", "trainer.total_steps=5", "trainer.save_every=2", "trainer.max_restarts=1",
            "warmstart.steps=0", "trainer.stall_timeout_s=8"]
    staged = tmp_path / "fault.staged"
    staged.write_text("stop")
    returncode, output = fault_after_step_2(tmp_path, args, lambda proc: staged.rename(tmp_path / "fault"))
    assert returncode == 0, output[-3000:]
    assert (tmp_path / "faulted").exists()
    assert "a worker made no progress for trainer.stall_timeout_s=8" in output and "restart 1/1" in output, \
        output[-3000:]
    # e.g. "hybrid rank 0 (Advantage, PolicySender, Reward; pid 7981): in PolicySender.push_weights
    # (stages/policy.py:236) > WeightBroadcast._broadcast (engine/reshard.py:383)"
    assert re.search(r"^  \w+ rank 0 \([\w, ]*PolicySender[\w, ]*; pid \d+\): in PolicySender\.push_weights "
                     r"\(stages/policy\.py:\d+\) > WeightBroadcast\._broadcast \(engine/reshard\.py:\d+\)", output,
                     re.MULTILINE), output[-3000:]
    assert re.search(r"^  rollout rank 0 \(Rollout; pid \d+\): stopped; ", output, re.MULTILINE), output[-3000:]
    client, run = only_run(tmp_path)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "trainer/restarts")] == [1]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")][-1] == 5
    assert client.list_artifacts(run.info.run_id, "hang"), "the stacks are kept with the run"
