"""bench/e2e.py's shared inputs: the tokenizer covers every model id, EOS can never be sampled, and
every prompt is exactly `--prompt-len` tokens through both frameworks' paths."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import e2e  # noqa: E402
from e2e_reward import rlflow_score, trl_reward  # noqa: E402

from rlflow.engine.data.prompts import load_prompts  # noqa: E402


def test_inputs_give_both_frameworks_the_same_full_length_prompts(tmp_path):
    args = argparse.Namespace(prompt_len=24, new=8, seed=0, prompts=3)
    model_dir, train, val = e2e.build_inputs(tmp_path, "tiny", args, torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = e2e.SHAPES["tiny"]["vocab_size"]
    assert tok.eos_token_id == vocab and tok.pad_token_id == vocab - 1  # EOS is outside the logits
    tokens = tok.convert_ids_to_tokens(list(range(vocab)))
    assert None not in tokens and len(set(tokens)) == vocab
    prompts, counts = load_prompts([str(train), str(val)], tok, args.prompt_len, "error")  # rlflow's path
    assert counts["kept"] == args.prompts + 1 and {len(p.ids) for p in prompts} == {args.prompt_len}
    assert {len(tok(p.text)["input_ids"]) for p in prompts} == {args.prompt_len}  # TRL's: the plain text


def test_reward_adapters_agree_and_vary():
    texts = [" abcd abce", " abcd abcf", " abce"]
    assert trl_reward(texts) == [rlflow_score("e2e", t, "") for t in texts] == [0.5, 1.0, 0.0]


def test_variants_count_the_gpus_their_pools_take(tmp_path):
    conf = tmp_path / "job.yaml"
    for settings, gpus in (([], 1), (["placement.own_pool=[rollout]"], 2), (["placement.workers=2"], 2),
                           (["placement.own_pool=[rollout,reward]"], 2)):
        args = argparse.Namespace(prompts=4, samples=2, prompt_len=8, new=8, lr=1e-6, rlflow_micro_tokens=64,
                                  steps=2, seed=0)
        conf.write_text(e2e.yaml.safe_dump(e2e.rlflow_conf(args, True, tmp_path, tmp_path / "t.jsonl",
                                                           tmp_path / "v.jsonl", tmp_path / "out", settings)))
        assert e2e.gpus_used(conf) == gpus, settings


def test_busy_share_is_each_gpus_mean_utilization_inside_the_window():
    peak = e2e.DevicePeak()
    peak.samples = [(0.0, [(100.0, 0.0), (50.0, 0.0)]), (1.0, [(900.0, 80.0), (50.0, 20.0)]),
                    (2.0, [(2048.0, 60.0), (60.0, 40.0)]), (3.0, [(10.0, 0.0), (10.0, 0.0)])]
    assert peak.busy(1.0, 2.0) == [0.7, 0.3] and peak.busy(5.0, 6.0) == []
    assert peak.gib == 2.0
