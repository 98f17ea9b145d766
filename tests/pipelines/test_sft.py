"""End-to-end SFT: the real CLI on 16 training rows (prompt/response rows and ground-truth rows) and
the embedded validation rows, a real local Ray cluster, a real sqlite MLflow store."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from test_e2e import BIN, env, history, only_run

from rlflow.engine.data import task

pytestmark = pytest.mark.slow
# one step = one optimizer step over all 16 training rows
TINY = ("data.prompts_per_step=16", "actor.mini_batch_prompts=16", "data.val_max_prompts=32", "actor.lr=3e-3",
        "trainer.total_steps=3", "trainer.val_every=2", "trainer.save_every=2")


def rlflow_sft(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    truth = task.build_data(tmp_path / "data", n_train=8, n_val=1, seed=3)["train"]  # ground truth as the response
    rows = tmp_path / "sft.jsonl"  # prompt/response rows; one overlong response, counted and skipped
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "response": str(2 * a)}) + "\n" for a in range(8))
                    + json.dumps({"prompt": "1+1=", "response": "2" * 20}) + "\n")
    cmd = [str(BIN / "rlflow"), "train", "demo-sft", f"trainer.output_dir={tmp_path / 'out'}",
           f"data.train_files=[{truth},{rows}]", *TINY, *overrides]  # held-out: the embedded validation rows
    proc = subprocess.run(cmd, env=env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    rlflow_sft(tmp)
    return tmp


def test_sft_run_lowers_the_loss_logs_and_exports(sft_run):
    from transformers import AutoModelForCausalLM

    client, run = only_run(sft_run)
    assert run.info.status == "FINISHED" and run.data.tags["algorithm"] == "sft"
    assert run.data.params["algorithm.name"] == "sft" and run.data.params["warmstart.steps"] == "0"
    m = {k: dict(v) for k, v in history(client, run.info.run_id).items()}
    for key in ("sft/loss", "sft/grad_norm", "sft/lr", "timing_s/step", "perf/throughput"):
        assert sorted(m[key]) == [1, 2, 3], key
    assert sorted(m["val/sft/loss"]) == [0, 2, 3]
    assert m["sft/lr"][1] == pytest.approx(3e-3)
    assert m["sft/loss"][3] < m["sft/loss"][2] < m["sft/loss"][1]  # the same 16 rows each step: the loss falls
    assert m["val/sft/loss"][3] < m["val/sft/loss"][0]
    assert (m["data/rows"][0], m["data/kept"][0], m["data/overlong"][0]) == (17, 16, 1)
    out = sft_run / "out"
    start = load_file(out / "embedded" / "model" / "model.safetensors")
    end = load_file(out / "hf_model" / "model.safetensors")
    assert any(not torch.equal(start[k], end[k]) for k in start)
    model = AutoModelForCausalLM.from_pretrained(out / "hf_model")
    assert torch.equal(model.state_dict()["model.norm.weight"], end["model.norm.weight"])
    assert not (out / "warmstart").exists()
    assert {"config.yaml", "checkpoints", "hf_model"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def test_sft_resumes_and_two_workers_match_one(sft_run, tmp_path):
    rlflow_sft(tmp_path, "placement.workers=2", "trainer.total_steps=2", "trainer.dag=plain")
    resumed = rlflow_sft(tmp_path, "placement.workers=2", "trainer.dag=plain")  # on to step 3
    assert "at step 2" in resumed.stdout
    client, run = only_run(tmp_path)  # one MLflow run across both jobs
    two = {k: dict(v) for k, v in history(client, run.info.run_id).items() if k.startswith(("sft/", "val/"))}
    client, run = only_run(sft_run)
    one = {k: dict(v) for k, v in history(client, run.info.run_id).items() if k.startswith(("sft/", "val/"))}
    # the same rows split over two ranks, stopped and resumed: through the all-reduce, the same updates
    assert sorted(two["sft/loss"]) == [1, 2, 3]
    for key, values in one.items():
        for step, value in values.items():
            assert two[key][step] == pytest.approx(value, rel=1e-4, abs=1e-6), (key, step)


def test_the_warm_starts_dev_prompts_are_held_out_of_its_examples(model_dir, data_files):
    from transformers import AutoTokenizer

    from rlflow.engine.data.prompts import load_examples, load_prompts
    from rlflow.pipelines.sft import hold_out

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples, _ = load_examples([data_files["train"]], tok, 64, 16)
    prompts, _ = load_prompts([data_files["train"]], tok, 64)
    kept, dev = hold_out(examples, prompts, 100, seed=0)
    assert len(dev) == 100 and len(kept) == len(examples) - 100 == 412
    assert not {tuple(p.ids) for p in dev} & {tuple(e[0]) for e in kept}
    assert [p.ids for p in hold_out(examples, prompts, 100, seed=0)[1]] == [p.ids for p in dev]  # seeded
    assert len(hold_out(examples, prompts, 10_000, seed=0)[1]) == 256  # never more than half the prompts
