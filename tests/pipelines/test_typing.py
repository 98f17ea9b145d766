"""The typed stage handles must stay typed: mypy rejects a misspelt verb and a wrong arity, and
accepts the right call. If `Group.at` decayed to `Any`, the two bad files would pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAD = """
from typing import Any
from rlflow.pipelines.runtime import Group, Stages
from rlflow.engine.train.losses import PolicyGradient, Supervised
from rlflow.stages.policy import Policy
from rlflow.stages.reward import Reward

def f(policy: Group[Policy], reward: Group[Reward], stages: Stages, batch: Any, pg: PolicyGradient,
      sft: Supervised) -> None:
"""
CASES = {
    "right": ("    reward.at(0, Reward.score, batch)\n    policy.at(1, Policy.update, batch, pg)\n"
              "    stages.policy.at(0, Policy.logprobs, batch)\n    policy.at(0, Policy.evaluate, batch, sft)\n", None),
    "misspelt": ("    policy.at(0, Policy.updat, batch, pg)\n", 'has no attribute "updat"'),
    "arity": ("    reward.at(0, Reward.score, batch, batch)\n", "Too many arguments"),
    "wrong stage": ("    reward.at(0, Policy.update, batch, pg)\n", "incompatible type"),
    "a loss that cannot evaluate": ("    policy.at(0, Policy.evaluate, batch, pg)\n", "incompatible type"),
    "wrong stage of a pipeline's stages": ("    stages.policy.at(0, Reward.score, batch)\n", "incompatible type"),
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict[str, str]:
    """mypy's output per case, from one run over one file per case."""
    d = tmp_path_factory.mktemp("typing")
    files = {name: d / f"case_{i}.py" for i, name in enumerate(CASES)}
    for name, path in files.items():
        path.write_text(HEAD + CASES[name][0])
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           *map(str, files.values())], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return {name: "\n".join(line for line in proc.stdout.splitlines() if line.startswith(str(path)))
            for name, path in files.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_mypy_checks_stage_calls_by_name_and_arity(checked, case):
    expected = CASES[case][1]
    if expected is None:
        assert checked[case] == ""
    else:
        assert expected in checked[case], checked[case]
