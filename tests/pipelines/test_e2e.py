"""End-to-end: the real CLI, a real local Ray cluster, a real sqlite MLflow store, a few real steps."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from rlflow.pipelines.sft import CHECK_EVERY

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow
NOISY = ("timing_s/", "perf/throughput", "system/")


def env(tmp_path: Path) -> dict[str, str]:
    """A run's environment: its own sqlite MLflow store in `tmp_path` (a copy of an empty one that
    MLflow made once per session: creating its tables costs each run about 5 s otherwise)."""
    store = tmp_path / "mlflow.db"
    if not store.exists():
        shutil.copy(empty_store(tmp_path.parent), store)
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


@functools.cache
def empty_store(root: Path) -> Path:
    """An empty store in `root`, pytest's directory of this session's temporary paths (it cleans them up)."""
    path = root / "empty-mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()  # MLflow creates and migrates its tables
    return path


# A user's own reward, loaded by path. Unlike arithmetic, a barely warmed-up policy scores on it
# unevenly, so every group has a learning signal and the update must move the weights.
LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)
"""


def rlflow(tmp_path: Path, out: str, *overrides: str, timeout: int = 400,
           conf: str = "smoke") -> subprocess.CompletedProcess:
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    # the recipe by name, from a directory outside the repo, as a user runs it
    cmd = [str(BIN / "rlflow"), "train", conf, f"trainer.output_dir={tmp_path / out}",
           f"reward.function={reward}:compute_score", *overrides]
    proc = subprocess.run(cmd, env=env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def stage_workers(pid: int) -> list:
    """The stage worker processes under `pid`; one that exits while being listed is left out."""
    import psutil

    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "StageWorker" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def fault_after_step_2(tmp_path: Path, args: list[str],
                       fault: Callable[[subprocess.Popen], None]) -> tuple[int, str]:
    """Run `args` in the background, call `fault` on it once its step-2 checkpoint is complete
    (or it ended, or 300 s passed), and return its exit code and output; it never outlives the call."""
    proc = subprocess.Popen(args, env=env(tmp_path), cwd=tmp_path, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        marker = tmp_path / "out" / "checkpoints" / "step_000002" / "COMPLETE"
        deadline = time.time() + 300
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        fault(proc)
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output


def history(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    keys = client.get_run(run_id).data.metrics
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in keys}


def only_run(tmp_path: Path, experiment: str = "rlflow"):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compiled")
    proc = rlflow(tmp, "out", "trainer.register_model=smoke-policy")
    (tmp / "terminal.txt").write_text(proc.stdout + proc.stderr)
    return tmp


def test_the_terminal_shows_rlflow_lines_not_library_chatter(compiled_run):
    shown = (compiled_run / "terminal.txt").read_text()
    for chatter in ("Generating train split", "Writing model shards", "Loading weights",
                    "Token authentication is enabled", "system_metrics_monitor"):
        assert chatter not in shown, chatter
    assert re.search(r"^rlflow: run \w+ finished", shown, re.MULTILINE), shown[-2000:]


def test_compiled_run_learns_logs_and_exports(compiled_run):
    client, run = only_run(compiled_run)
    assert run.info.status == "FINISHED"
    metrics = history(client, run.info.run_id)
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm",
                "actor/kl_loss", "critic/score/mean", "response_length/mean", "prompt_length/mean",
                "perf/throughput", "timing_s/gen", "timing_s/update_actor", "timing_s/ref",
                "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max"):
        assert [s for s, _ in metrics[key]] == [1, 2, 3], key
    assert [s for s, _ in metrics["val/arith/greedy_score"]] == [0, 2, 3]
    assert run.data.params["rollout.samples_per_prompt"] == "4"
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "checkpoints", "hf_model", "samples"} <= top
    tables = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert "samples/step_000003.json" in tables
    inputs = {(i.dataset.name, i.tags[0].value) for i in run.inputs.dataset_inputs}
    assert inputs == {("train.parquet", "train"), ("val.parquet", "val")}
    [version] = client.search_model_versions("name='smoke-policy'")
    assert version.run_id == run.info.run_id and version.source == f"runs:/{run.info.run_id}/model"
    # the policy moved away from the warm-start it began with
    out = compiled_run / "out"
    start, end = load_file(out / "warmstart" / "model.safetensors"), load_file(out / "hf_model" / "model.safetensors")
    assert any(not torch.equal(start[k], end[k]) for k in start)


def test_export_turns_the_latest_checkpoint_into_a_hf_directory(compiled_run, tmp_path):
    from transformers import AutoModelForCausalLM

    proc = subprocess.run([str(BIN / "rlflow"), "export", str(compiled_run / "out"), str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step_000003" in proc.stdout
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    final = load_file(compiled_run / "out" / "hf_model" / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in final.items())
    _, run = only_run(compiled_run)
    assert len(run.data.tags["dataset_hash"]) == 12
    bad = subprocess.run([str(BIN / "rlflow"), "export", str(tmp_path / "nothing"), str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "neither a complete checkpoint" in bad.stderr


def test_eval_of_the_run_directory_matches_the_final_validation(compiled_run):
    out = compiled_run / "out"
    # the run's own config, reward and validation prompts, in one generate call as validation made
    reward = f"reward.function={compiled_run}/length_reward.py:compute_score"
    proc = subprocess.run([str(BIN / "rlflow"), "eval", str(out), str(ROOT / "conf" / "smoke.yaml"), reward,
                           f"trainer.output_dir={out}", "data.prompts_per_step=16", "actor.mini_batch_prompts=16",
                           "trainer.experiment=eval"],
                          env=env(compiled_run), cwd=compiled_run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client, run = only_run(compiled_run, "eval")
    assert run.data.tags["model"] == str((out / "checkpoints" / "step_000003").resolve())
    m = run.data.metrics
    assert m["eval/arith/prompts"] == 16
    _, train = only_run(compiled_run)
    # greedy decoding of the final checkpoint: the same answers, so the same score, as the final validation
    assert m["eval/arith/accuracy"] == train.data.metrics["val/arith/greedy_score"]
    assert 0 <= m["eval/arith/pass_at_1"] <= m["eval/arith/pass_at_2"] <= m["eval/arith/pass_at_4"] <= 1


def steady_history(tmp_path: Path) -> dict[str, list[tuple[int, float]]]:
    """The only run's metric history under `tmp_path`, without the ones that vary run to run."""
    client, run = only_run(tmp_path)
    return {k: v for k, v in history(client, run.info.run_id).items() if not k.startswith(NOISY)}


def test_plain_mode_gives_identical_metrics(compiled_run, tmp_path):
    rlflow(tmp_path, "out", "trainer.dag=plain")
    assert steady_history(compiled_run) == steady_history(tmp_path)


def test_deterministic_mode_closes_the_rollout_trainer_gap_and_repeats_exactly(compiled_run, tmp_path):
    """algorithm.rollout_correction=exact: at every step the rollout's logprobs equal the trainer's
    old ones bit for bit (mismatch 0, probability gap 0, correction weights 1), where the default
    mode's differ in their last bits; a second run, through plain calls this time, logs the same
    numbers."""
    for run, extra in (("a", ()), ("b", ("trainer.dag=plain",))):
        (tmp_path / run).mkdir()
        rlflow(tmp_path / run, "out", "algorithm.rollout_correction=exact", *extra)
    exact, again = steady_history(tmp_path / "a"), steady_history(tmp_path / "b")
    assert exact == again
    for key in ("rollout_correction/mismatch_kl", "training/rollout_probs_diff_max"):
        assert [v for _, v in exact[key]] == [0.0, 0.0, 0.0], key
    assert [v for _, v in exact["rollout_correction/weight_max"]] == [1.0, 1.0, 1.0]
    assert max(v for _, v in steady_history(compiled_run)["training/rollout_probs_diff_max"]) > 0


def test_split_placement_gives_identical_metrics_and_resumes(compiled_run, tmp_path):
    """The rollout in a pool of its own, fed by the trainer's broadcast after every update: the same
    samples, so the same numbers, as the hybrid run on CPU fp32; the rollout's weight version rises
    by one a step; a resumed run (plain calls, two ranks a pool this time) pushes the checkpoint's
    weights before its first generation."""
    split = ("placement.own_pool=[rollout]",)
    rlflow(tmp_path, "out", *split)
    got = steady_history(tmp_path)
    hybrid = steady_history(compiled_run)
    assert hybrid.pop("perf/reshard_gb_from_peers")  # the in-place reshard's, which only the hybrid engine runs
    assert got.pop("perf/weight_sync_gb") and hybrid.pop("perf/weight_sync_gb")  # a push's bytes, a reshard's
    assert got == hybrid
    assert got["rollout/weight_version"] == [(1, 0.0), (2, 1.0), (3, 2.0)]

    resumed = rlflow(tmp_path, "out", *split, "trainer.total_steps=4", "trainer.val_every=0", "trainer.dag=plain",
                     "placement.workers=2")
    assert "at step 3" in resumed.stdout
    after = {k: dict(v) for k, v in steady_history(tmp_path).items()}
    assert after["rollout/weight_version"][4] == 3  # the checkpoint's version, pushed at load
    assert after["training/rollout_probs_diff_max"][4] < 1e-4  # and its weights, not the initial ones


LORA = ["actor.lora_rank=8", "actor.lr=5e-3", "actor.kl_loss_coef=0.05"]  # adapters, the base as the reference
# the smoke recipe's sizes, for a run of another embedded recipe that is as small
SMOKE_SIZES = ["data.prompts_per_step=8", "data.val_max_prompts=16", "rollout.samples_per_prompt=4",
               "rollout.max_new_tokens=4", "actor.mini_batch_prompts=4", "warmstart.steps=3"]


def test_lora_split_placement_pushes_the_adapters_alone_and_matches_hybrid(tmp_path):
    """A LoRA trainer pushes its adapters only; the rollout pool merges them beside its own copy of
    the base, into the same weights the hybrid engine's merge gives: the same numbers on CPU fp32."""
    steps = [*SMOKE_SIZES, *LORA, "trainer.total_steps=3", "trainer.val_every=0"]
    for placement, extra in (("hybrid", []), ("split", ["placement.own_pool=[rollout]"])):
        (tmp_path / placement).mkdir()
        rlflow(tmp_path / placement, "out", *steps, *extra, conf="demo-lora")
    hybrid, split = steady_history(tmp_path / "hybrid"), steady_history(tmp_path / "split")
    hybrid.pop("perf/reshard_gb_from_peers")
    merged, adapters = dict(hybrid.pop("perf/weight_sync_gb")), dict(split.pop("perf/weight_sync_gb"))
    assert adapters[3] < merged[3] / 4  # rank-8 adapters against the whole 0.8M-parameter model
    assert split == hybrid
    assert split["training/rollout_probs_diff_max"][-1][1] < 1e-4

    # `rlflow eval` of a LoRA run merges its checkpoint's adapters into their base: the final
    # validation's greedy answers again
    run = tmp_path / "hybrid"
    proc = subprocess.run([str(BIN / "rlflow"), "eval", str(run / "out"), str(ROOT / "conf" / "smoke.yaml"),
                           f"reward.function={run}/length_reward.py:compute_score", f"trainer.output_dir={run / 'out'}",
                           "data.prompts_per_step=16", "actor.mini_batch_prompts=16", "trainer.experiment=eval"],
                          env=env(run), cwd=run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, evaluated = only_run(run, "eval")
    _, trained = only_run(run)
    assert evaluated.data.metrics["eval/arith/accuracy"] == trained.data.metrics["val/arith/greedy_score"]


def test_resume_after_sigkill_replays_the_uninterrupted_run(compiled_run, tmp_path):
    # full weights; a LoRA checkpoint's resume is tested below, on another number of workers
    steps = ["trainer.save_every=2"]  # killed after step 2 of 3; the uninterrupted run is `compiled_run`
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    args = [str(BIN / "rlflow"), "train", str(ROOT / "conf" / "smoke.yaml"), f"trainer.output_dir={tmp_path}/out",
            f"reward.function={tmp_path / 'length_reward.py'}:compute_score", *steps]
    proc = subprocess.Popen(args, env=env(tmp_path), cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = tmp_path / "out" / "checkpoints" / "step_000002" / "COMPLETE"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "no checkpoint appeared before the kill"
    resumed = rlflow(tmp_path, "out", *steps)
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    client, run = only_run(tmp_path)  # the resumed job logs into the run it interrupted
    assert run.info.status == "FINISHED"
    got = {k: dict(v) for k, v in history(client, run.info.run_id).items() if not k.startswith(NOISY)}
    assert sorted(got["actor/pg_loss"]) == [1, 2, 3]
    want = {k: dict(v) for k, v in steady_history(compiled_run).items()}
    assert got == want  # step for step, the same numbers as a run that was never killed


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_the_same_command_resumes(tmp_path):
    steps = ["trainer.total_steps=8", "trainer.save_every=2", "trainer.val_every=0"]
    args = [str(BIN / "rlflow"), "train", str(ROOT / "conf" / "smoke.yaml"), f"trainer.output_dir={tmp_path}/out",
            f"reward.function={tmp_path / 'length_reward.py'}:compute_score", *steps]
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    # as a terminal's Ctrl-C does: SIGINT to the whole process group (Ray's processes included)
    returncode, output = fault_after_step_2(tmp_path, args, lambda proc: os.killpg(proc.pid, signal.SIGINT))
    assert returncode == 128 + signal.SIGINT, output[-3000:]
    stopped = re.search(r"stopped by SIGINT after step (\d+); checkpoint (\S+);", output)
    assert stopped, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    step, ckpt = int(stopped[1]), Path(stopped[2])
    assert 2 <= step < 8 and ckpt.name == f"step_{step:06d}" and (ckpt / "COMPLETE").exists()
    config = json.loads((ckpt / "driver.json").read_text())["config"]  # what made it, resolved
    assert config["trainer"]["total_steps"] == 8 and config["reward"]["function"].endswith("reward.py:compute_score")
    client, run = only_run(tmp_path)
    assert run.info.status == "KILLED"
    assert sorted({m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")}) == list(
        range(1, step + 1))  # the step that was running when the signal came finished, and was saved

    resumed = rlflow(tmp_path, "out", *steps)
    assert f"resumed from {ckpt} at step {step}" in resumed.stdout
    client, run = only_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert sorted({m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")}) == list(range(1, 9))


def test_a_killed_worker_is_rebuilt_and_the_run_finishes(tmp_path):
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    args = [str(BIN / "rlflow"), "train", str(ROOT / "conf" / "smoke.yaml"), f"trainer.output_dir={tmp_path}/out",
            f"reward.function={tmp_path / 'length_reward.py'}:compute_score", "trainer.total_steps=5",
            "trainer.save_every=2", "trainer.max_restarts=1"]

    def kill_workers(proc: subprocess.Popen) -> None:
        workers = stage_workers(proc.pid)
        assert workers, "no stage worker process found"
        for p in workers:
            p.kill()

    returncode, output = fault_after_step_2(tmp_path, args, kill_workers)
    assert returncode == 0, output[-3000:]
    assert "restart 1/1 from" in output and "step_000002" in output
    client, run = only_run(tmp_path)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "trainer/restarts")] == [1]
    assert run.data.tags["restart.1"].startswith("step ")  # the event, with the error that caused it
    assert sorted({m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")}) == [1, 2, 3, 4, 5]
    assert run.info.status == "FINISHED"


# A user's reward that hangs on its first call only (a file marks it), as a stuck kernel or
# collective would hang a stage: longer than the stall timeout, shorter than its own. Every other
# call takes 0.4 s, so a step's 32 rows take longer than the stall timeout too, moving all along.
STALLING_REWARD = """
import pathlib, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    mark = pathlib.Path(__file__).with_suffix(".stalled")
    if not mark.exists():
        mark.write_text("")
        time.sleep(300)
    time.sleep(0.4)
    return float(len(solution_str) % 2)
"""


def test_a_stuck_step_is_stopped_after_the_stall_timeout_a_slow_one_is_not_and_the_run_finishes(tmp_path):
    reward = tmp_path / "stalling_reward.py"
    reward.write_text(STALLING_REWARD)
    began = time.time()
    # no accuracy measured in the warm start, which would call the reward first (and has no
    # restarts); validation only at the end, on 4 prompts, greedy
    proc = rlflow(tmp_path, "out", f"reward.function={reward}:compute_score", "reward.timeout_s=600",
                  "trainer.stall_timeout_s=8", "trainer.max_restarts=1", "trainer.total_steps=2",
                  "warmstart.stop_accuracy=0", "trainer.val_every=0", "data.val_max_prompts=4",
                  "trainer.val_samples=0")
    assert "a worker made no progress for trainer.stall_timeout_s=8 at step 0" in proc.stdout, proc.stdout[-3000:]
    assert "restart 1/1" in proc.stdout and "restart 2/" not in proc.stdout  # the slow steps go on
    assert time.time() - began < 250  # abandoned, not waited out
    # before the restart, what each worker was doing: the stage verb, rlflow's innermost frame,
    # and the thread that runs the user's function, at its line
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("  hybrid rank 0 (")]
    assert re.search(r"in Reward\.score \(stages/reward\.py:\d+\) > .* thread rlflow-reward in "
                     rf"compute_score \({reward}:7\)$", line), line
    client, run = only_run(tmp_path)
    [hang] = client.list_artifacts(run.info.run_id, "hang")
    assert {a.path.rpartition("/")[2] for a in client.list_artifacts(run.info.run_id, hang.path)} == {
        "summary.txt", "hybrid_rank0.txt"}
    assert [m.value for m in client.get_metric_history(run.info.run_id, "trainer/restarts")] == [1]
    step_s = [m.value for m in client.get_metric_history(run.info.run_id, "timing_s/step")]
    assert min(step_s) > 8, step_s  # each step ran past the stall timeout, and moved
    assert sorted({m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")}) == [1, 2]
    assert run.info.status == "FINISHED"


@pytest.mark.parametrize("weights", [[], LORA], ids=["full", "lora"])
def test_checkpoint_from_two_workers_resumes_on_one(tmp_path, weights):
    # two data-parallel ranks (gloo all-reduce) with the reward stage split into its own pool
    rlflow(tmp_path, "out", "placement.workers=2", "placement.own_pool=[reward]", "trainer.total_steps=2",
           "trainer.val_every=0", *weights)
    resumed = rlflow(tmp_path, "out", "placement.workers=1", "trainer.total_steps=3", "trainer.val_every=0", *weights)
    assert "at step 2" in resumed.stdout
    client, run = only_run(tmp_path)
    assert sorted({m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")}) == [1, 2, 3]


def test_tensor_parallel_generation_agrees_with_the_trainer(tmp_path):
    # two ranks generate as one TP group of 2: each update is resharded into the TP layout, and the
    # trainer's probabilities of what the group sampled must be the engine's own
    # one validation prompt for two ranks: the second has none, yet must generate with its group
    rlflow(tmp_path, "out", "placement.workers=2", "rollout.tp=2", "trainer.total_steps=2", "trainer.val_every=0",
           "data.val_max_prompts=1", "trainer.log_checkpoint=false")
    client, run = only_run(tmp_path)
    assert [step for step, _ in history(client, run.info.run_id)["val/greedy_score"]] == [2]
    # the final checkpoint stays on disk, not copied into the run
    assert (tmp_path / "out" / "checkpoints" / "step_000002" / "model.safetensors").is_file()
    assert "checkpoints" not in {a.path for a in client.list_artifacts(run.info.run_id)}
    diff = history(client, run.info.run_id)["training/rollout_probs_diff_max"]
    assert [step for step, _ in diff] == [1, 2]
    assert max(v for _, v in diff) < 1e-5, diff


def test_an_estimator_of_the_users_own_runs_end_to_end(tmp_path):
    """The custom-algorithm how-to's estimator, as its page writes it, named by file: the run carries
    its name, and its advantages are its own (+1, 0 or -1 on every trained token; GRPO's are not
    whole numbers)."""
    page = (ROOT / "docs" / "howto" / "custom-algorithm.md").read_text()
    (tmp_path / "my_estimator.py").write_text(re.search(r"```python\n# my_estimator.py\n(.*?)```", page, re.S)[1])
    rlflow(tmp_path, "out", "algorithm.advantage=my_estimator.py:SIGN", "trainer.total_steps=1", "trainer.val_every=0")
    client, run = only_run(tmp_path)
    assert run.data.tags["algorithm"] == "sign" and run.info.status == "FINISHED"
    metrics = history(client, run.info.run_id)
    extremes = [v for k in ("critic/advantages/max", "critic/advantages/min") for _, v in metrics[k]]
    assert len(extremes) == 2 and set(extremes) <= {-1.0, 0.0, 1.0} and 1.0 in extremes, extremes


def test_the_python_api_refuses_a_setting_that_cannot_work_before_anything_starts():
    """`rlflow.train` checks as `rlflow train` does; its run is in the loopback test below."""
    import rlflow

    with pytest.raises(rlflow.ConfigError, match="verl's rollout.n is rollout.samples_per_prompt"):
        rlflow.train("smoke", {"rollout.n": 4})


def test_mlflow_run_makes_exactly_one_run(tmp_path):
    overrides = (f"trainer.output_dir={tmp_path}/out data.prompts_per_step=8 data.val_max_prompts=16 "
                 "actor.mini_batch_prompts=4 rollout.max_new_tokens=4 warmstart.steps=2")
    proc = subprocess.run([str(BIN / "mlflow"), "run", str(ROOT), "--env-manager", "local", "-P", "steps=3",
                           "-P", "samples_per_prompt=4", "-P", f"overrides={overrides}"],
                          env=env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1
    run = runs[0]
    assert run.data.params["trainer.total_steps"] == "3"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == [1, 2, 3]
    assert {"config.yaml", "hf_model", "checkpoints"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


# Each shipped algorithm config, shrunk to one tiny step, and the metrics only it logs.
# The shipped recipes that change what the driver does, as the how-tos run them; those that change
# only the loss or the advantage (gspo, cispo, drgrpo) update through the verbs in
# tests/stages/test_policy.py, and demo-remax runs below with dynamic sampling on top.
ALGORITHMS = {
    "demo-dapo": ("dynamic_sampling/rounds", "dynamic_sampling/varied_groups", "reward/overlong_penalty/mean"),
    "demo-agent": ("episode/turns/mean", "episode/tool_calls/mean", "episode/truncated"),
}
ONE_TINY_STEP = ("data.prompts_per_step=8", "data.val_max_prompts=8", "rollout.max_new_tokens=4",
                 "actor.mini_batch_prompts=4", "warmstart.steps=3", "trainer.total_steps=1",
                 "trainer.val_every=0", "trainer.val_samples=2")


@pytest.mark.parametrize("conf", sorted(ALGORITHMS))
def test_each_shipped_algorithm_trains_and_logs_its_metrics(conf, tmp_path):
    proc = rlflow(tmp_path, "out", *ONE_TINY_STEP, conf=conf)
    assert re.findall(r"^warm-start: step (\d+)/3, loss [\d.]+, [\d.]+ s a step$", proc.stdout, re.M) == ["1", "2", "3"]
    assert re.search(r"^validation at step 1: greedy score [\d.]+$", proc.stdout, re.M), proc.stdout[-2000:]
    client, run = only_run(tmp_path)
    assert run.info.status == "FINISHED"
    metrics = {k: dict(v) for k, v in history(client, run.info.run_id).items()}
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm", "critic/score/mean", *ALGORITHMS[conf]):
        assert list(metrics[key]) == [1], key
    # validation at the end: greedy, and mean@2 / pass@2 of two samples; pass@2 can only be higher
    source = "calc" if conf == "demo-agent" else "arith"
    for key in (f"val/{source}/greedy_score", f"val/{source}/mean_at_2", f"val/{source}/pass_at_2"):
        assert list(metrics[key]) == [1], key
    assert metrics[f"val/{source}/pass_at_2"][1] >= metrics[f"val/{source}/mean_at_2"][1]
    out = tmp_path / "out"
    start, end = load_file(out / "warmstart" / "model.safetensors"), load_file(out / "hf_model" / "model.safetensors")
    assert any(not torch.equal(start[k], end[k]) for k in start)
    if conf == "demo-dapo":  # dynamic sampling: bounded rounds; a short step is topped up and counted
        rounds, varied = metrics["dynamic_sampling/rounds"][1], metrics["dynamic_sampling/varied_groups"][1]
        assert 1 <= rounds <= 10
        assert metrics["dynamic_sampling/topped_up_groups"][1] == max(0, 8 - varied)
        assert rounds == 10 or varied >= 8
        assert metrics["reward/overlong_penalty/mean"][1] <= 0


def test_the_warm_start_ends_once_held_out_training_prompts_reach_its_accuracy(tmp_path):
    """The embedded task's own scorer: a random model answers almost none of 2-digit sums, and a
    few hundred supervised steps get some right; the warm start stops at its first measurement at
    or above warmstart.stop_accuracy, well before warmstart.steps."""
    cmd = [str(BIN / "rlflow"), "train", str(ROOT / "conf" / "smoke.yaml"), f"trainer.output_dir={tmp_path}/out",
           "warmstart.steps=1000",
           "warmstart.stop_accuracy=0.01", "trainer.total_steps=1", "trainer.val_every=0"]
    proc = subprocess.run(cmd, env=env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client, run = only_run(tmp_path)
    checks = sorted((m.step + 1, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                             "warmstart/dev_accuracy"))
    assert checks[-1][0] < 1000 and checks[-1][1] >= 0.01 and all(v < 0.01 for _, v in checks[:-1]), checks
    assert f"reached warmstart.stop_accuracy=0.01 at step {checks[-1][0]}" in proc.stdout
    assert [s for s, _ in checks] == list(range(CHECK_EVERY, checks[-1][0] + 1, CHECK_EVERY))


def test_remax_with_dynamic_sampling_scores_the_kept_prompts_greedy_answers(tmp_path):
    """The driver generates the rounds, and then the greedy answers of the prompts it kept."""
    rlflow(tmp_path, "out", *ONE_TINY_STEP, "algorithm.dynamic_sampling_tries=3", "rollout.samples_per_prompt=2",
           "placement.workers=2", conf="demo-remax")
    client, run = only_run(tmp_path)
    m = run.data.metrics
    assert 1 <= m["dynamic_sampling/rounds"] <= 3 and 0 <= m["reward/greedy_baseline/mean"] <= 1
    assert m["timing_s/baseline"] > 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm extra not installed")
@pytest.mark.parametrize("free_cache", [False, True])  # released while training, it takes them on waking
def test_vllm_backend_gets_every_update(tmp_path, monkeypatch, free_cache):
    # the compiled graph calls generate from a thread of its own; with torch's OpenMP preloaded, as
    # vLLM asks on CPU (and leaves set in a process that built an engine), vLLM's attention aborted
    # when that thread was not the one that built the engine
    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if gomp.exists():
        monkeypatch.setenv("LD_PRELOAD", str(gomp))
    rlflow(tmp_path, "out", "rollout.backend=vllm", "trainer.total_steps=2", "trainer.val_every=0",
           "trainer.dag=compiled", f"rollout.free_cache={free_cache}")
    client, run = only_run(tmp_path)
    assert run.data.params["rollout.backend"] == "vllm"
    metrics = history(client, run.info.run_id)
    assert [s for s, _ in metrics["actor/pg_loss"]] == [1, 2]
    # step 2 samples with step 1's update: vLLM's probabilities still are the trainer's
    diffs = [v for _, v in metrics["training/rollout_probs_diff_max"]]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm extra not installed")
def test_vllm_generates_for_two_trainer_ranks_in_split_placement(tmp_path):
    # vLLM runs one engine per process and refuses a process group: a split rollout pool forms none
    # (it needs one only for TP), so two data-parallel trainer ranks can use it
    rlflow(tmp_path, "out", "rollout.backend=vllm", "placement.workers=2", "placement.own_pool=[rollout]",
           "trainer.total_steps=2", "trainer.val_every=0", "trainer.dag=plain")
    client, run = only_run(tmp_path)
    metrics = history(client, run.info.run_id)
    assert [v for _, v in metrics["rollout/weight_version"]] == [0, 1]
    diffs = [v for _, v in metrics["training/rollout_probs_diff_max"]]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs


def test_sequence_parallel_training_agrees_with_the_rollout(tmp_path):
    # two ranks train as one SP group of 2 (each half of every row's tokens): the trainer's
    # probabilities of what the rollout sampled must still be the engine's own, and the update runs
    # three validation prompts over two ranks: 1 and 2, none dropped
    rlflow(tmp_path, "out", "placement.workers=2", "actor.sp=2", "trainer.total_steps=2", "trainer.val_every=0",
           "data.val_max_prompts=3")
    client, run = only_run(tmp_path)
    metrics = history(client, run.info.run_id)
    assert [step for step, _ in metrics["val/greedy_score"]] == [2]
    assert [step for step, _ in metrics["actor/pg_loss"]] == [1, 2]
    diff = metrics["training/rollout_probs_diff_max"]
    assert max(v for _, v in diff) < 1e-5, diff


def listening(pids: list[int]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket the processes `pids` listen on."""
    import psutil

    found = set()
    for pid in pids:
        try:
            p = psutil.Process(pid)
            found |= {(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections("tcp") if c.status == "LISTEN"}
        except psutil.Error:  # exited while being listed
            pass
    return found


def is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address.split("%")[0])
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def test_the_self_started_cluster_listens_on_loopback_only(tmp_path):
    """Every process of a run on the cluster a job starts itself (Ray's servers and agents, the
    stage workers, the compiled graph's proxy, the driver) and every group the stages open (two
    data-parallel groups and the weight broadcast of a split placement) listens on loopback only.
    The job is a notebook's: `rlflow.train(recipe, overrides)`, which returns the MLflow run's id."""
    import psutil

    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    settings = {"trainer.output_dir": f"{tmp_path}/out",
                "reward.function": f"{tmp_path}/length_reward.py:compute_score", "trainer.total_steps": 2,
                "trainer.val_every": 0, "placement.workers": 2, "placement.own_pool": ["rollout"]}
    args = [sys.executable, "-c", f"import rlflow\nprint('run', rlflow.train('smoke', {settings!r}))"]
    run_env = {k: v for k, v in env(tmp_path).items() if k not in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME")}
    proc = subprocess.Popen(args, env=run_env, cwd=tmp_path, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: set[tuple[str, str, int]] = set()
    try:
        while proc.poll() is None:
            try:
                tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            seen |= listening(tree)
            time.sleep(0.3)
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-3000:]
    client, run = only_run(tmp_path)
    assert output.splitlines()[-1] == f"run {run.info.run_id}" and run.info.status == "FINISHED"
    names = {name for name, _, _ in seen}
    assert {"gcs_server", "raylet"} <= names and any("StageWorker" in n for n in names), names  # it looked
    assert [s for s in seen if not is_loopback(s[1])] == []
