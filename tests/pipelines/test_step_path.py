"""docs/architecture.md lists every file of the project one GRPO step visits, from the command line
to the gradient, and this test keeps the list true: it traces a real step on the CPU with
`sys.setprofile` (the command's config, the data, then one step graph over the real stages in this
process: generate, score, old logprobs, advantages, update) and compares the files that ran with
the page's list. The list cannot drift from the code; the files' count is a budget the page states."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- step path: checked by tests/pipelines/test_step_path.py -->", "<!-- end of step path -->"


def listed() -> set[str]:
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page[page.index(BEGIN):page.index(END)]
    return set(re.findall(r"^\| `([\w/.]+\.py)` \|", section, re.M))


def one_step(model_dir: Path, data_files: dict[str, str]) -> None:
    """`rlflow train smoke` on the given model and data, as the driver runs a step, in this process."""
    from transformers import AutoTokenizer

    from rlflow.engine.data.prompts import PromptLoader, load_prompts
    from rlflow.pipelines import cli, driver, grpo
    from rlflow.pipelines.runtime import LOCAL, Group, InPlace, Stages
    from rlflow.stages.advantage import Advantage
    from rlflow.stages.hybrid import HybridPolicy
    from rlflow.stages.reward import Reward
    from rlflow.stages.worker import StageWorker

    cfg = cli.parse(["smoke", f"model.path={model_dir}", f"data.train_files=[{data_files['train']}]",
                     f"data.val_files=[{data_files['val']}]", "rollout.max_new_tokens=4"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, _ = load_prompts(cfg.data.train_files, tokenizer, cfg.data.max_prompt_tokens)
    worker = StageWorker(0, 1, 1)
    worker.add(HybridPolicy, dict(cfg=cfg, model_path=str(model_dir), world=1, device="cpu", rank=0))
    worker.add(Reward, dict(cfg=cfg, device="cpu"))
    worker.add(Advantage, dict(cfg=cfg, rank=0))
    policy = Group(HybridPolicy, [worker], LOCAL)
    stages = Stages(policy=policy, generator=policy, sync=InPlace(), reward=Group(Reward, [worker], LOCAL),
                    advantage=Group(Advantage, [worker], LOCAL))
    algo = grpo.GRPO(cfg, str(model_dir), [])  # as the driver's loop runs a step (pipelines/driver.py)
    inputs, _ = algo.inputs(stages, PromptLoader(prompts, cfg.data.prompts_per_step, cfg.trainer.seed), 0)
    outputs, _ = algo.graph(stages, inputs)
    metrics = algo.metrics(outputs, 1.0)
    driver.check_health(metrics, None)
    assert outputs[0].weight_version == 1 and "actor/pg_loss" in metrics  # the optimizer stepped


def visited_by_one_step(model_dir: Path, data_files: dict[str, str]) -> set[str]:
    """The project's files (as the repo holds them: engine/..., stages/..., pipelines/...) whose code
    runs in one step, imports made beforehand so that an import alone does not count."""
    one_step(model_dir, data_files)  # once untraced: every module imported, every lazy import done
    seen: set[str] = set()

    def profile(frame, event, arg) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        one_step(model_dir, data_files)
    finally:
        sys.setprofile(None)
    files = {str(Path(f).resolve().relative_to(ROOT)) for f in seen if Path(f).resolve().is_relative_to(ROOT)}
    return {f for f in files if f.startswith(("engine/", "stages/", "pipelines/"))}


@pytest.mark.slow
def test_the_architecture_page_lists_every_file_a_grpo_step_visits(model_dir, data_files):
    visited = visited_by_one_step(model_dir, data_files)
    assert visited == listed(), (f"visited, not listed: {sorted(visited - listed())}; "
                                 f"listed, not visited: {sorted(listed() - visited)}")
