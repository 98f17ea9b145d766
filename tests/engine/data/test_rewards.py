"""engine/data/rewards.py: answer extraction on hand-written strings, function loading, batch error handling."""

from __future__ import annotations

import logging
import math
import pickle
import textwrap
import time

import pytest

from rlflow.engine.data import task
from rlflow.engine.data.rewards import (
    BUILTIN,
    RewardError,
    RewardFunction,
    gsm8k_score,
    last_boxed,
    math_score,
    python_exec_score,
)
from rlflow.engine.specs import load_function


@pytest.mark.parametrize("text, truth, method, expected", [
    ("so the total is #### 1,234", "1234", "strict", 1.0),
    ("#### 72 and then #### 73", "73", "strict", 1.0),  # the last marker wins
    ("The answer is #### $5.", "5", "strict", 1.0),
    ("#### 18.0", "18", "strict", 1.0),  # compared as numbers, not strings
    ("#### -3", "-3", "strict", 1.0),
    ("#### 12", "13", "strict", 0.0),
    ("The answer is 1,234", "1234", "strict", 0.0),  # no marker: strict gives nothing
    ("#### unsure, maybe 4", "4", "strict", 0.0),
    ("3 apples and 4 pears make 7", "7", "flexible", 1.0),
    ("It costs $1,234.", "1234", "flexible", 1.0),
    ("7 is wrong, it is 8", "7", "flexible", 0.0),
    ("no digits at all", "7", "flexible", 0.0),
    ("#### 72", "Natalia sold 48 + 24 = 72 clips.\n#### 72", "strict", 1.0),  # full GSM8K solution
])
def test_gsm8k_score(text: str, truth: str, method: str, expected: float) -> None:
    assert gsm8k_score("openai/gsm8k", text, truth, method=method) == expected


def test_gsm8k_rejects_unknown_method() -> None:
    with pytest.raises(ValueError, match="strict"):
        gsm8k_score("gsm8k", "#### 1", "1", method="loose")


def test_builtin_table() -> None:
    assert BUILTIN["arith"] is task.compute_score
    assert BUILTIN["gsm8k"] is BUILTIN["openai/gsm8k"] is gsm8k_score
    assert BUILTIN["python_exec"] is python_exec_score


SOURCE = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)
"""


def test_load_function_from_module(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_reward_mod.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_function("my_reward_mod:score")
    assert fn("x", "a", "a") == 1.0 and fn("x", "a", "b") == 0.0


def test_load_function_from_file(tmp_path) -> None:
    path = tmp_path / "sub" / "reward_file.py"
    path.parent.mkdir()
    path.write_text(SOURCE)
    assert load_function(f"{path}:score")("x", "a", "a") == 1.0


@pytest.mark.parametrize("spec, match", [
    ("no_colon_here", "package.module:name"),
    ("rlflow.engine.data.task:", "package.module:name"),
    ("rlflow.engine.data.task:not_there", "not_there"),
    ("no_such_module_xyz:f", "no_such_module_xyz"),
    ("/nonexistent/dir/r.py:f", "not found"),
])
def test_load_function_bad_specs(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_function(spec)
    with pytest.raises(TypeError, match="not a function"):
        load_function("rlflow.engine.data.task:DATA_SOURCE")


def write_reward(tmp_path, body: str) -> str:
    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent(body))
    return f"{path}:compute_score"


def batch(solutions: list[str]) -> tuple[list, list, list, list]:
    n = len(solutions)
    return ["src"] * n, solutions, ["1"] * n, [None] * n


def test_failures_score_zero_are_counted_and_logged_once(tmp_path, caplog) -> None:
    spec = write_reward(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "boom":
                raise ZeroDivisionError("bad sample")
            if solution_str == "nan":
                return float("nan")
            if solution_str == "inf":
                return float("inf")
            if solution_str == "text":
                return "1.0"
            if solution_str == "none":
                return None
            return True if solution_str == "bool" else 1.0
    """)
    with caplog.at_level(logging.WARNING, logger="rlflow.reward"):
        scores, metrics, extras = RewardFunction(spec)(*batch(["ok", "boom", "nan", "boom", "text",
                                                                "inf", "none", "bool"]))
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert metrics["reward/errors"] == 6 and metrics["reward/error_rate"] == 6 / 8
    assert extras == [{}] * 8
    warnings = [r for r in caplog.records if r.name == "rlflow.reward"]
    assert len(warnings) == 1
    assert "ZeroDivisionError" in warnings[0].getMessage() and "'src'" in warnings[0].getMessage()


def test_dict_results_give_extras_and_averaged_metrics(tmp_path) -> None:
    spec = write_reward(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "plain":
                return 0.5
            if solution_str == "noscore":
                return {"acc": 1.0}
            return {"score": 2.0, "acc": float(solution_str), "pred": "text is not a metric"}
    """)
    scores, metrics, extras = RewardFunction(spec)(*batch(["1", "0", "plain", "noscore"]))
    assert scores == [2.0, 2.0, 0.5, 0.0]
    assert extras == [{"acc": 1.0}, {"acc": 0.0}, {}, {}]
    assert metrics == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/error_rate": 0.25,
                       "reward/acc/mean": 0.5}  # mean over the samples reporting it


def test_on_error_raise_names_the_sample(tmp_path) -> None:
    spec = write_reward(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1 / int(solution_str)
    """)
    with pytest.raises(RewardError, match="sample 2") as info:
        RewardFunction(spec, on_error="raise")(*batch(["1", "2", "0"]))
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert str(info.value).endswith(f"({spec.split(':')[0]}:3)")  # the user's line that raised


def test_builtin_scorers_by_data_source() -> None:
    scores, metrics, _ = RewardFunction()(["arith", "arith", "gsm8k"], [" 12 ", "13", "#### 1,000"],
                                          ["12", "12", "1000"], [None, {"index": 1}, None])
    assert scores == [1.0, 0.0, 1.0]
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/error_rate": 0.0}


def test_unknown_data_source_without_function_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="reward.function") as info:
        RewardFunction(on_error="zero")(["my/dataset"], ["x"], ["y"], [None])
    assert "my/dataset" in str(info.value)


def test_pickles_by_spec(tmp_path) -> None:
    spec = write_reward(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.25
    """)
    clone = pickle.loads(pickle.dumps(RewardFunction(spec, "raise", 2.5)))
    assert (clone.on_error, clone.timeout_s) == ("raise", 2.5)
    assert math.isclose(clone(*batch(["a"]))[0][0], 0.25)


HANGS = """
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(60)
        return 1.0
"""


def test_a_call_past_the_timeout_scores_zero_and_the_next_call_still_works(tmp_path, caplog) -> None:
    fn = RewardFunction(write_reward(tmp_path, HANGS), timeout_s=0.5)
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="rlflow.reward"):
        scores, metrics, _ = fn(*batch(["a", "hang", "b"]))
    assert time.perf_counter() - start < 2.0
    assert scores == [1.0, 0.0, 1.0]
    assert metrics["reward/timeouts"] == metrics["reward/errors"] == 1
    assert "sample 1" in caplog.text and "timed out after 0.5s" in caplog.text
    assert fn(*batch(["c", "d"]))[0] == [1.0, 1.0]  # the stuck thread was replaced
    with pytest.raises(RuntimeError, match="sample 0 .*timed out after 0.5s"):
        RewardFunction(fn.spec, "raise", 0.5)(*batch(["hang"]))


def test_fast_path_scores_a_large_batch_and_timeout_zero_calls_directly(tmp_path) -> None:
    spec = write_reward(tmp_path, """
        import threading

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": 1.0, "on_caller": float(threading.current_thread() is threading.main_thread())}
    """)
    scores, metrics, _ = RewardFunction(spec)(*batch(["x"] * 512))
    assert scores == [1.0] * 512
    assert metrics["reward/on_caller/mean"] == 0.0  # ran on the worker thread
    assert RewardFunction(spec, timeout_s=0)(*batch(["x"]))[1]["reward/on_caller/mean"] == 1.0


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{textwrap.dedent(code)}```\nIt adds."


@pytest.mark.parametrize("response, tests, expected", [
    (fenced("def add(a, b):\n    return a + b\n"), "assert add(2, 3) == 5", 1.0),
    (fenced("def add(a, b):\n    return a - b\n"), "assert add(2, 3) == 5", 0.0),
    ("def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5", 1.0),  # no fence: the whole text
    (fenced("def add(a, b):\n    return 0\n") + fenced("def add(a, b):\n    return a + b\n"),
     "assert add(2, 3) == 5", 1.0),  # the last block wins
    (fenced("x = bytearray(4 * 1024**3)\n"), "", 0.0),  # over the 1 GiB address-space limit
    (fenced("import os\n"), "assert os.environ.get('RLFLOW_SECRET') is None", 1.0),
])
def test_python_exec_score(response: str, tests: str, expected: float, monkeypatch) -> None:
    monkeypatch.setenv("RLFLOW_SECRET", "hunter2")  # inherited by a plain subprocess, not by the sandbox
    assert python_exec_score("python_exec", response, tests) == expected


def test_python_exec_infinite_loop_scores_zero_within_its_timeout() -> None:
    start = time.perf_counter()
    assert python_exec_score("python_exec", fenced("while True:\n    pass\n"), "", {"timeout_s": 1}) == 0.0
    assert time.perf_counter() - start < 3.0


@pytest.mark.parametrize("text, expected", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{1} then \\boxed{2}", "2"),  # the last box wins
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not nest
    ("\\boxed {x^{2}}", "x^{2}"),
    ("\\boxed{3} and \\boxed{\\frac{1}{2}", None),  # the last box is unclosed
    ("the answer is 4", None),
])
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize("response, truth, expected", [
    ("So \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac12", 1.0),  # numerically equal, \frac12 shorthand
    ("\\boxed{3/4}", "\\tfrac{3}{4}", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{x = 5.}", "5", 1.0),
    ("\\boxed{\\$1,000}", "1000", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\text{(B)}}", "(B)", 1.0),
    ("\\boxed{18.0}", "$18$", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{2}", "\\frac{1}{2}", 0.0),
    ("\\boxed{1,2}", "12", 0.0),  # a list, not a thousands comma
    ("\\boxed{\\rightarrow}", "arrow", 0.0),  # only \left and \right themselves are dropped
    ("the answer is 5", "5", 0.0),  # no box
    ("\\boxed{5}", "Thus the answer is $\\boxed{5}$.", 1.0),  # a full solution as ground truth
])
def test_math_score(response: str, truth: str, expected: float) -> None:
    assert math_score("math", response, truth) == expected


def test_math_score_rejects_an_empty_ground_truth_and_is_builtin() -> None:
    with pytest.raises(ValueError, match="no answer"):
        math_score("math", "\\boxed{1}", " $ $ ")
    assert BUILTIN["math"] is BUILTIN["lighteval/MATH"] is math_score
    scores, metrics, _ = RewardFunction()(["math", "lighteval/MATH"], ["\\boxed{\\frac{2}{4}}", "\\boxed{7}"],
                                          ["\\frac{1}{2}", "8"], [None, None])
    assert scores == [1.0, 0.0] and metrics["reward/errors"] == 0
