"""End-to-end DPO: the real CLI on 16 training pairs and the embedded validation pairs, a real
local Ray cluster, a real sqlite MLflow store."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from test_e2e import BIN, env, history, only_run

from rlflow.engine.data import task
from rlflow.engine.data.prompts import load_pairs
from rlflow.pipelines.dpo import chosen_as_truth

pytestmark = pytest.mark.slow
# one step = one optimizer step over all 16 training pairs, so `dpo/*` at step s measures the
# training set after s - 1 updates
TINY = ("data.prompts_per_step=16", "actor.mini_batch_prompts=16", "data.val_max_prompts=32", "actor.lr=1e-3",
        "warmstart.steps=20", "warmstart.stop_accuracy=0", "trainer.total_steps=8",
        "trainer.val_every=4")


def rlflow_dpo(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    train = task.build_pairs(tmp_path / "pairs", n_train=16, n_val=1, seed=3)["train"]
    cmd = [str(BIN / "rlflow"), "train", "demo-dpo", f"trainer.output_dir={tmp_path / 'out'}",
           f"data.train_files=[{train}]", *TINY, *overrides]  # held-out: the embedded validation pairs
    proc = subprocess.run(cmd, env=env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    rlflow_dpo(tmp)
    return tmp


def test_dpo_run_widens_the_margin_logs_and_exports(dpo_run):
    tmp_path = dpo_run
    client, run = only_run(tmp_path)
    assert run.info.status == "FINISHED" and run.data.tags["algorithm"] == "dpo"
    assert run.data.params["dpo.beta"] == "0.1" and run.data.params["algorithm.name"] == "dpo"
    m = {k: dict(v) for k, v in history(client, run.info.run_id).items()}
    for key in ("dpo/loss", "dpo/reward_margin", "dpo/reward_accuracy", "dpo/chosen_reward", "dpo/rejected_reward",
                "dpo/nll", "dpo/grad_norm", "timing_s/ref", "timing_s/update_actor", "timing_s/step"):
        assert sorted(m[key]) == list(range(1, 9)), key
    for key in ("val/loss", "val/reward_margin", "val/reward_accuracy", "val/chosen_reward", "val/rejected_reward",
                "val/nll"):
        assert sorted(m[key]) == [0, 4, 8], key
    # before any update the policy is the reference: every implicit reward is 0 and the DPO part of
    # the loss is ln 2; conf/demo-dpo.yaml adds the chosen answers' NLL (dpo.nll_coef=1)
    assert run.data.params["dpo.nll_coef"] == "1.0" and m["val/nll"][0] > 0
    assert m["val/loss"][0] - m["val/nll"][0] == pytest.approx(math.log(2), abs=1e-5) and m["val/reward_margin"][0] == 0
    assert m["dpo/loss"][1] - m["dpo/nll"][1] == pytest.approx(math.log(2), abs=1e-5) and m["dpo/reward_margin"][1] == 0
    margins = [m["dpo/reward_margin"][s] for s in range(1, 9)]
    # the training pairs' margin widens (the first update at lr 1e-3 may overshoot it below 0)
    assert margins[-1] > max(margins[3], 0) and margins[3] > margins[1], margins
    assert m["dpo/reward_accuracy"][8] > 0.5
    assert m["data/kept"][0] == 16
    out = tmp_path / "out"
    start, end = load_file(out / "warmstart" / "model.safetensors"), load_file(out / "hf_model" / "model.safetensors")
    assert any(not torch.equal(start[k], end[k]) for k in start)
    assert {"config.yaml", "checkpoints", "hf_model"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def test_dpo_resumes_where_it_stopped_with_the_same_numbers(dpo_run, tmp_path):
    short = ("trainer.val_every=0", "trainer.total_steps=2")
    rlflow_dpo(tmp_path, *short)
    resumed = rlflow_dpo(tmp_path, *short[:1], "trainer.total_steps=3")
    assert "at step 2" in resumed.stdout and "warm-start: reusing" in resumed.stdout
    client, run = only_run(tmp_path)  # one MLflow run across both jobs
    got = {k: dict(v) for k, v in history(client, run.info.run_id).items() if k.startswith("dpo/")}
    assert sorted(got["dpo/loss"]) == [1, 2, 3]
    # `dpo_run` never stopped; its lr is constant and validation changes no weights, so its first steps are these
    client, run = only_run(dpo_run)
    want = {k: {s: x for s, x in v if s <= 3}
            for k, v in history(client, run.info.run_id).items() if k.startswith("dpo/")}
    assert got == want  # step for step, as a run that never stopped


def test_two_workers_and_a_reference_pool_match_one_worker(dpo_run, tmp_path):
    rlflow_dpo(tmp_path, "placement.workers=2", "placement.own_pool=[reference]", "trainer.total_steps=2")
    client, run = only_run(tmp_path)
    two = {k: dict(v) for k, v in history(client, run.info.run_id).items() if k.startswith(("dpo/", "val/"))}
    client, run = only_run(dpo_run)
    one = {k: dict(v) for k, v in history(client, run.info.run_id).items() if k.startswith(("dpo/", "val/"))}
    assert sorted(two["dpo/loss"]) == [1, 2] and sorted(two["val/loss"]) == [0, 2]
    # the same pairs, split over two ranks: the same means and, through the all-reduce, the same updates
    for key, values in two.items():
        for step in set(values) & set(one[key]):  # validation ran at 0 and 2 here, at 0, 4 and 8 there
            assert values[step] == pytest.approx(one[key][step], rel=1e-4, abs=1e-6), (key, step)


def test_the_warm_starts_held_out_pairs_score_their_chosen_answer_right_and_the_near_miss_wrong(tmp_path, model_dir):
    """Before DPO the warm start stops on the greedy accuracy of held-out training pairs, scored
    against their chosen answers by the run's reward (the embedded task's, by data_source)."""
    from transformers import AutoTokenizer

    files = task.build_pairs(tmp_path, n_train=64, n_val=1, seed=5)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs, _ = load_pairs([files["train"]], tok, 64, 8)
    prompts = chosen_as_truth(pairs, tok)
    assert len(prompts) == len(pairs) == 64 and [p.ids for p in prompts] == [p.prompt for p in pairs]
    for pair, prompt in zip(pairs, prompts):
        answer = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        assert task.compute_score(prompt.data_source, answer(pair.chosen), prompt.ground_truth) == 1.0
        assert task.compute_score(prompt.data_source, answer(pair.rejected), prompt.ground_truth) == 0.0


def test_a_warm_start_left_with_no_examples_is_refused(tmp_path):
    from rlflow.engine.config import ConfigError, load_config
    from rlflow.engine.data.prompts import Example, Prompt
    from rlflow.pipelines.sft import supervised

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}"], job="dpo")
    examples: list[Example] = []  # a training set smaller than the held-out prompts (fewer than 32: all, each step)
    dev = [Prompt([1, 2], "arith", "34", None, "")] * 8
    with pytest.raises(ConfigError, match="the warm start has no examples once 8 prompts are held out to measure "
                                          "its accuracy: set warmstart.stop_accuracy=0"):
        supervised(cfg, "unused: refused before any stage starts", examples, 0, None, dev)  # type: ignore[arg-type]
