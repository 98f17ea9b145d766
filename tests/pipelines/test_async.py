"""Generating ahead of training (trainer.max_staleness > 0), end to end: the real CLI, a real local
Ray cluster, a real sqlite MLflow store, a rollout pool of its own."""

from __future__ import annotations

import json
import re

import pytest
from test_e2e import BIN, fault_after_step_2, history, only_run, rlflow, steady_history

pytestmark = pytest.mark.slow


def test_async_trains_at_most_k_versions_behind_and_resumes_without_skipping_a_prompt(tmp_path):
    """trainer.max_staleness=1: the rollout pool generates step t+1 while the trainer updates on
    step t, so from the second step every batch is one weight version old, never more; a checkpoint
    holds the loader where a synchronous run's is, and the resumed run (k=2 now: two steps queued
    ahead) generates the batches that were in flight again, from the checkpoint's weights, and
    trains none more than two versions old."""
    ahead = ("placement.own_pool=[rollout]", "trainer.val_every=0", "algorithm.rollout_correction=token_tis")
    rlflow(tmp_path, "out", *ahead, "trainer.max_staleness=1", "trainer.total_steps=4", "trainer.save_every=2")
    client, run = only_run(tmp_path)
    got = history(client, run.info.run_id)
    assert got["async/staleness/max"] == [(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)]
    assert got["rollout/weight_version"] == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 2.0)]
    assert got["training/rollout_probs_diff_max"][1][1] > 1e-4  # the gap a version makes, corrected
    assert got["rollout_correction/mismatch_kl"][1][1] > 0

    state = json.loads((tmp_path / "out" / "checkpoints" / "step_000004" / "driver.json").read_text())
    assert state["loader"] == {"epoch": 0, "position": 4 * 8, "seed": 0}  # 4 steps of 8 prompts, not 5

    resumed = rlflow(tmp_path, "out", *ahead, "trainer.max_staleness=2", "trainer.total_steps=7")
    assert "at step 4" in resumed.stdout
    after = dict(history(client, run.info.run_id)["async/staleness/max"])
    assert after[5] == 0.0 and after[6] == 1.0  # regenerated from the checkpoint's weights, then one behind
    assert after[7] in (1.0, 2.0)  # queued two steps ahead: the version depends on when the pool started it
    state = json.loads((tmp_path / "out" / "checkpoints" / "step_000007" / "driver.json").read_text())
    assert state["loader"]["position"] == 7 * 8


# Three turns whatever the model says, each scored by the length of what it said: the groups'
# scores differ, so every update moves the weights.
TALK = """
from rlflow.engine.agents.env import Step


class Talk:
    def __init__(self, prompt):
        self.turns = 0

    def step(self, response):
        self.turns += 1
        return Step(None if self.turns == 3 else "go on", float(len(response) % 3) / 2, self.turns == 3)
"""


def test_deterministic_mode_repeats_multi_turn_episodes_one_step_off_exactly(tmp_path):
    """algorithm.rollout_correction=exact, generating one step ahead, three-turn episodes (each
    later turn continues its history in the engine): two runs at one seed log the same numbers at
    every step; the first step (nothing ahead yet) has no gap between the rollout's logprobs and
    the trainer's, the later ones the gap of one weight version."""
    (tmp_path / "talk.py").write_text(TALK)
    args = ("placement.own_pool=[rollout]", "trainer.max_staleness=1", "algorithm.rollout_correction=exact",
            f"rollout.env={tmp_path / 'talk.py'}:Talk", "rollout.max_turns=3", "rollout.max_new_tokens=6",
            "rollout.episode_tokens=48", "data.prompts_per_step=8", "actor.mini_batch_prompts=4",
            "warmstart.steps=0", "trainer.total_steps=3", "trainer.val_every=0")
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        rlflow(tmp_path / run, "out", *args, conf="demo-agent")
    got, again = ({k: v for k, v in steady_history(tmp_path / run).items() if not k.endswith("time_s")}
                  for run in ("a", "b"))  # the episodes' wall times vary
    assert got == again
    assert got["episode/turns/mean"] == [(1, 3.0), (2, 3.0), (3, 3.0)]
    assert got["async/staleness/max"] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    mismatch = [v for _, v in got["rollout_correction/mismatch_kl"]]
    assert mismatch[0] == 0.0 and min(mismatch[1:]) > 0, mismatch
    assert min(v for _, v in got["actor/grad_norm"]) > 0


FAILS_ONCE = """
import os
import signal
import time
from pathlib import Path

from rlflow.engine.agents.env import Step

HERE = Path(__file__).parent


class FailsOnce:
    \"\"\"One turn, scored on the task's answer; once `fault` exists, the first episode kills its worker
    (`fault` says "dies") or sleeps in it, far past the step timeout (as a stuck kernel would).\"\"\"

    def __init__(self, prompt):
        self.truth = prompt.ground_truth
        if (HERE / "fault").exists() and not (HERE / "faulted").exists():
            (HERE / "faulted").touch()
            if (HERE / "fault").read_text() == "dies":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)

    def step(self, response):
        return Step(None, float(response.strip() == self.truth), True)
"""


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_async_replaces_a_lost_rollout_worker_while_training_goes_on(tmp_path, fault):
    """Generating ahead, a rollout worker killed mid-generation, or stuck in it with no work done
    for trainer.stall_timeout_s while its second thread still answers (the fault comes from its
    environment, so it lands in the rollout pool's process), is replaced by a new pool holding the
    trainer's current weights; the trainer's workers are never restarted and every step trains once."""
    (tmp_path / "fails_once.py").write_text(FAILS_ONCE)
    args = [str(BIN / "rlflow"), "train", f"trainer.output_dir={tmp_path}/out", "placement.own_pool=[rollout]",
            "trainer.max_staleness=1", "algorithm.rollout_correction=token_tis", "trainer.val_every=0",
            f"rollout.env={tmp_path / 'fails_once.py'}:FailsOnce", "rollout.max_turns=1", "rollout.episode_tokens=8",
            "trainer.total_steps=6", "trainer.save_every=2", "trainer.max_restarts=1", "warmstart.steps=0",
            "trainer.stall_timeout_s=8",
            "reward.timeout_s=900"]  # the environment's own timeout: longer than the hang, so the watchdog finds it
    staged = tmp_path / "fault.staged"
    staged.write_text(fault)  # renamed into place: an episode never reads a half-written file
    returncode, output = fault_after_step_2(tmp_path, args, lambda proc: staged.rename(tmp_path / "fault"))
    assert returncode == 0, output[-3000:]
    assert (tmp_path / "faulted").exists()
    lost = "died" if fault == "dies" else "made no progress for trainer.stall_timeout_s=8"
    assert f"a rollout worker {lost}" in output and "new rollout pool 1/1" in output, output[-3000:]
    if fault == "hangs":  # said before the pool is replaced: the environment's own frame, in its thread
        assert re.search(r"^  rollout rank 0 \(Rollout; pid \d+\): in Rollout\.generate \(stages/rollout\.py:\d+\) "
                         r">.* thread rlflow-env in FailsOnce\.__init__ \(.*fails_once\.py:\d+\)$", output,
                         re.MULTILINE), output[-3000:]
    assert "restart 1/1" not in output
    client, run = only_run(tmp_path)
    got = history(client, run.info.run_id)
    assert "trainer/restarts" not in got
    assert got["async/rollout_rebuilds"][-1] == (6, 1.0)
    assert [s for s, _ in got["actor/pg_loss"]] == [1, 2, 3, 4, 5, 6]
    rebuilt = next(s for s, n in got["async/rollout_rebuilds"] if n == 1.0)
    assert dict(got["async/staleness/max"])[rebuilt] == 0.0  # regenerated from the trainer's weights of that step
    if fault == "hangs":  # what the stuck worker was doing, kept with the run
        assert [a.path for a in client.list_artifacts(run.info.run_id, "hang")] == [f"hang/step_{rebuilt - 1:06d}"]
