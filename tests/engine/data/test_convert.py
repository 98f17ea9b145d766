"""engine/data/convert.py: hand-written GSM8K and MATH rows in, verl rows out that load and score."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from rlflow.engine.data import task
from rlflow.engine.data.convert import INSTRUCTIONS, convert
from rlflow.engine.data.prompts import load_prompts
from rlflow.engine.data.rewards import RewardFunction

GSM8K_LINES = [
    {"question": "Natalia sold 48 clips and then 24 more. How many?", "answer": "48 + 24 = <<48+24=72>>72\n#### 72"},
    {"question": "A house costs $1,234 more than $0. Price?", "answer": "It is 1,234.\n#### 1,234"},
    {"question": "Only a question"},  # missing answer
    {"question": 7, "answer": "#### 7"},  # a number, not a string
    {"question": "No marker?", "answer": "The answer is 5."},
    {"question": "Marker without a number?", "answer": "#### five"},
    {"question": "   ", "answer": "#### 1"},
    ["not", "an", "object"],
]


def write_jsonl(path: Path, rows: list, extra_lines: tuple[str, ...] = ()) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return str(path)


def written(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_gsm8k_rows_are_converted_and_bad_rows_counted(tmp_path) -> None:
    src = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_LINES, ("{not json\n",))
    counts = convert(src, str(tmp_path / "out.parquet"), "gsm8k")
    assert counts == {"rows": 9, "written": 2, "skipped": 7, "skipped/missing_answer": 1,
                      "skipped/question_type": 1, "skipped/no_answer_marker": 1, "skipped/answer_not_number": 1,
                      "skipped/empty_question": 1, "skipped/row_type": 1, "skipped/bad_json": 1}
    rows = written(str(tmp_path / "out.parquet"))
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Natalia sold 48 clips and then 24 more. How many? Let's think "
                                               'step by step and output the final answer after "####".'}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, **GSM8K_LINES[0]},
    }
    assert rows[1]["reward_model"]["ground_truth"] == "1234"  # thousands comma dropped
    assert rows[1]["extra_info"]["index"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gsm8k.jsonl", "out.parquet"]  # no temp file left


MATH_ROWS = [
    {"problem": "Halve 1.", "solution": "Half of 1 is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
     "type": "Prealgebra"},
    {"problem": "Two boxes?", "solution": "Not \\boxed{3}, but $\\boxed{\\{1, 2\\}}$."},  # the last box wins
    {"problem": "Given answer", "solution": "Some working.", "answer": "\\sqrt{2}", "level": 5},
    {"problem": "No box", "solution": "The answer is 4."},
    {"problem": "Unclosed", "solution": "So \\boxed{\\frac{1}{2}"},
    {"problem": "Empty box", "solution": "\\boxed{ }"},
    {"problem": "Number solution", "solution": 4},
    {"solution": "\\boxed{1}"},  # missing problem
    {"problem": "Neither solution nor answer"},
]


def test_math_rows_take_the_last_balanced_box_or_the_given_answer(tmp_path) -> None:
    src = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    counts = convert(src, str(tmp_path / "out.jsonl"), "math", split="test")
    assert counts == {"rows": 9, "written": 3, "skipped": 6, "skipped/no_boxed": 3, "skipped/solution_type": 1,
                      "skipped/missing_problem": 1, "skipped/missing_solution": 1}
    rows = written(str(tmp_path / "out.jsonl"))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{2}", "\\{1, 2\\}", "\\sqrt{2}"]
    assert {r["data_source"] for r in rows} == {"math"}
    assert rows[0]["prompt"][0]["content"] == "Halve 1. Let's think step by step and put the final answer in \\boxed{}."
    assert rows[0]["extra_info"] == {"split": "test", "index": 0, **MATH_ROWS[0]}
    assert rows[2]["extra_info"] == {"split": "test", "index": 2, "problem": "Given answer",
                                     "solution": "Some working.", "answer": "\\sqrt{2}", "level": "5"}


def test_parquet_and_json_inputs_and_overrides(tmp_path) -> None:
    pd.DataFrame([{"problem": "1+1?", "solution": "\\boxed{2}"},
                  {"problem": "Missing solution", "solution": None}]).to_parquet(tmp_path / "m.parquet")
    counts = convert(str(tmp_path / "m.parquet"), str(tmp_path / "a.jsonl"), "math", data_source="lighteval/MATH",
                     instruction="", split="val")
    assert counts == {"rows": 2, "written": 1, "skipped": 1, "skipped/missing_solution": 1}
    (row,) = written(str(tmp_path / "a.jsonl"))
    assert row["data_source"] == "lighteval/MATH" and row["prompt"][0]["content"] == "1+1?"
    assert row["extra_info"]["split"] == "val"
    (tmp_path / "g.json").write_text(json.dumps(GSM8K_LINES[:2]))  # a JSON array
    assert convert(str(tmp_path / "g.json"), str(tmp_path / "b.jsonl"), "gsm8k")["written"] == 2


@pytest.mark.parametrize("fmt, rows", [("gsm8k", GSM8K_LINES), ("math", MATH_ROWS)])
def test_output_loads_as_prompts_and_its_truths_score_one(tmp_path, fmt: str, rows: list) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    convert(src, str(tmp_path / "out.parquet"), fmt)
    convert(src, str(tmp_path / "out.jsonl"), fmt)
    tokenizer = task.build_tokenizer()
    prompts, counts = load_prompts([str(tmp_path / "out.parquet")], tokenizer, 512)
    from_jsonl, _ = load_prompts([str(tmp_path / "out.jsonl")], tokenizer, 512)
    assert [p.ground_truth for p in prompts] == [p.ground_truth for p in from_jsonl]
    assert [p.text for p in prompts] == [p.text for p in from_jsonl]
    assert counts["kept"] == counts["rows"] == len(written(str(tmp_path / "out.jsonl")))
    assert all(p.text.endswith(INSTRUCTIONS[fmt]) for p in prompts)  # the template concatenates contents
    # A response giving each truth in the format the instruction asks for earns full reward.
    answers = [f"#### {p.ground_truth}" if fmt == "gsm8k" else f"\\boxed{{{p.ground_truth}}}" for p in prompts]
    scores, metrics, _ = RewardFunction(on_error="raise")([p.data_source for p in prompts], answers,
                                                          [p.ground_truth for p in prompts],
                                                          [p.extra_info for p in prompts])
    assert scores == [1.0] * len(prompts) and metrics["reward/errors"] == 0


def test_errors_name_the_file_and_leave_dst_untouched(tmp_path) -> None:
    dst = tmp_path / "out.parquet"
    dst.write_text("previous contents")
    bad = write_jsonl(tmp_path / "bad.jsonl", GSM8K_LINES[2:])
    with pytest.raises(ValueError, match="bad.jsonl") as info:
        convert(bad, str(dst), "gsm8k")
    assert "skipped/no_answer_marker" in str(info.value)
    with pytest.raises(ValueError, match="unknown format 'aime'"):
        convert(bad, str(dst), "aime")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        convert(str(tmp_path / "missing.jsonl"), str(dst), "gsm8k")
    with pytest.raises(ValueError, match="out.csv"):
        convert(write_jsonl(tmp_path / "ok.jsonl", GSM8K_LINES[:1]), str(tmp_path / "out.csv"), "gsm8k")
    (tmp_path / "in.txt").write_text("question")
    with pytest.raises(ValueError, match="in.txt"):
        convert(str(tmp_path / "in.txt"), str(dst), "gsm8k")
    assert dst.read_text() == "previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "in.txt", "ok.jsonl", "out.parquet"]


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch) -> None:
    def fail(table, where) -> None:
        Path(where).write_text("half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", fail)
    with pytest.raises(OSError, match="disk full"):
        convert(write_jsonl(tmp_path / "in.jsonl", GSM8K_LINES[:1]), str(tmp_path / "out.parquet"), "gsm8k")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
