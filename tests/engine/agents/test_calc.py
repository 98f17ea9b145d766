"""The embedded agent task's data: disjoint problems, and demonstrations that load as episodes."""

import pandas as pd
from transformers import AutoTokenizer

from rlflow.engine.agents.calc import ENV, Calculator, build_data
from rlflow.engine.agents.env import offered_tools
from rlflow.engine.data.prompts import Prompt, load_examples, load_prompts


def test_demonstrations_are_episodes_of_a_careless_demonstrator(tmp_path, model_dir):
    paths = build_data(tmp_path, n_train=512, n_val=64, seed=0)
    train, val, demos = (pd.read_parquet(paths[k]) for k in ("train", "val", "demos"))
    problem = lambda df: {p[0]["content"] for p in df["prompt"]}  # noqa: E731
    assert len(demos) == 256 and not problem(train) & problem(val) and problem(demos) <= problem(train)
    slips = [r[2]["content"] != r[1]["content"] for r in demos["response"]]
    assert sum(slips) == 192 and not any(slips[::4]), "three in four answers copy the result wrongly"
    assert build_data(tmp_path / "again", n_train=512, n_val=64, seed=0) and \
        pd.read_parquet(tmp_path / "again" / "demos.parquet").equals(demos)
    tok, tools = AutoTokenizer.from_pretrained(model_dir), offered_tools(ENV)
    examples, counts = load_examples([paths["demos"]], tok, 16, 72, tools=tools)
    assert counts["kept"] == 256 and tok.decode(examples[0].prompt).startswith("<calc>")
    prompts, _ = load_prompts([paths["val"]], tok, 16, tools=tools)
    env = Calculator(Prompt(prompts[0].ids, "calc", prompts[0].ground_truth, None, ""))
    assert env.step(f" {prompts[0].ground_truth}\n").reward == 1.0 and env.step("1").reward == 0.0
