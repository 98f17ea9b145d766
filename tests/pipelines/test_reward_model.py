"""End-to-end: GRPO whose reward mixes the rule with a real (tiny) reward model, through the real CLI."""

from __future__ import annotations

import subprocess

import pytest
from test_e2e import BIN, ONE_TINY_STEP, ROOT, env, history, only_run

pytestmark = pytest.mark.slow


def test_grpo_with_a_reward_model_logs_both_parts(tmp_path, reward_model_dir):
    cmd = [str(BIN / "rlflow"), "train", str(ROOT / "conf" / "smoke.yaml"), f"trainer.output_dir={tmp_path / 'out'}",
           *ONE_TINY_STEP, "trainer.total_steps=2", f"reward.model={reward_model_dir}", "reward.model_weight=0.5",
           "placement.own_pool=[reward]"]
    proc = subprocess.run(cmd, env=env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client, run = only_run(tmp_path)
    m = {k: dict(v) for k, v in history(client, run.info.run_id).items()}
    for key in ("reward/model/mean", "reward/rule/mean", "critic/score/mean"):
        assert sorted(m[key]) == [1, 2], key
    for step in (1, 2):  # the logged score is the configured mix of the two parts' means
        mix = m["reward/rule/mean"][step] + 0.5 * m["reward/model/mean"][step]
        assert m["critic/score/mean"][step] == pytest.approx(mix, abs=1e-5)
    assert m["reward/model/mean"][1] != m["reward/model/mean"][2]  # scored the step's own responses
