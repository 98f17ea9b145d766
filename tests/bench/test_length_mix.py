"""bench/length_mix.py: answers end at the drawn lengths in both frameworks' generation paths
(transformers' generate with the logits processor TRL is handed, and rlflow's native engine with
its patch), and the patch reaches a fresh process through the sitecustomize it writes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import length_mix  # noqa: E402

from rlflow.engine.rollout import native, scheduler  # noqa: E402
from rlflow.engine.rollout.base import SamplingParams  # noqa: E402

MIX = length_mix.Mix(seed=3, new=12)


def prompts_of(tok) -> list[list[int]]:
    return [tok.encode(t) for t in ("1+1=", "12+7=", "99+99=")]


def test_draws_depend_on_the_prompt_and_sample_only():
    a, b = [5, 6, 7], [5, 6, 8]
    draws = [length_mix.answer_length(MIX, p, j) for p in (a, b) for j in range(16)]
    assert draws == [length_mix.answer_length(MIX, p, j) for p in (a, b) for j in range(16)]
    assert all(1 <= n <= MIX.new for n in draws) and len(set(draws)) > 3  # a spread, within the cap
    assert draws[:16] != draws[16:]
    assert length_mix.samples_of([a, b, a, a, b]) == [0, 0, 1, 2, 1]
    lengths = length_mix.prompt_lengths(200, 256, seed=0)
    assert min(lengths) >= 16 and max(lengths) <= 256 and 80 < sorted(lengths)[100] < 125  # median ~102


def test_transformers_generate_ends_each_answer_with_eos_at_its_length(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [p for p in prompts_of(tok) for _ in range(2)]  # two samples each, as TRL lays them out
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p).flip(0) for p in prompts], batch_first=True,
                                          padding_value=tok.pad_token_id).flip(1)  # left-padded
    mask = (ids != tok.pad_token_id).long()
    calls = length_mix.force_ends(model, MIX, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=MIX.new,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    assert calls == [len(prompts)]
    for row, p, j in zip(out.tolist(), prompts, length_mix.samples_of(prompts)):
        n = length_mix.answer_length(MIX, p, j)
        assert row[n - 1] == tok.eos_token_id and tok.eos_token_id not in row[:n - 1], (row, n)


def test_native_engine_ends_each_sample_at_its_length(model_dir, monkeypatch):
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = prompts_of(tok)
    monkeypatch.setattr(scheduler, "Seq", scheduler.Seq)  # restored after the test
    length_mix.patch_native(scheduler, MIX)
    engine = native.NativeRollout(model_dir, tok, max_slots=4, max_len=64)
    groups = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=MIX.new, seed=1))
    for p, group in zip(prompts, groups):
        for j, c in enumerate(group):
            n = length_mix.answer_length(MIX, p, j)  # or shorter on a sampled EOS, which ends with it
            assert (len(c.token_ids), c.finish_reason) == (n, "length") or \
                (len(c.token_ids) < n and c.token_ids[-1] == tok.eos_token_id)


def test_the_hook_patches_the_engine_in_a_fresh_process(tmp_path):
    _, env = length_mix.hook_dir(tmp_path / "hook", MIX)
    code = ("import rlflow.engine.rollout.native, rlflow.engine.rollout.scheduler as s; "
            "print(s.Seq.__name__, s.Seq((1, 2), (0, 1), limit=99).limit)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, **env, "PYTHONPATH": env["PYTHONPATH"] + os.pathsep + str(ROOT)})
    assert out.stdout.split() == ["Drawn", str(length_mix.answer_length(MIX, [1, 2], 1))]
