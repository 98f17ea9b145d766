"""Rule rewards: decoded responses in, one finite score per response out, one call per batch.

A reward function has verl's signature ``compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict`` and is named by ``reward.function`` as "package.module:function"
or "path/to/file.py:function"; left empty, ``BUILTIN[data_source]`` scores each row.

Invariants:
- a sample whose function raises or returns a non-number, NaN or inf scores 0.0 and is counted in
  ``reward/errors`` (on_error="zero"), or fails the call naming the sample (on_error="raise");
- a failing batch logs one warning (its first failure), not one per sample;
- a dict result must hold "score"; its other finite numeric keys come back per sample in ``extras``
  and as ``reward/<key>/mean`` over the samples that reported them;
- an unknown data_source without ``reward.function`` is a config error and always raises;
- a configured function call running past ``timeout_s`` is a failure like any other ("timed out
  after Xs"), also counted in ``reward/timeouts``; the batch moves on without it (see ``_Worker``).
  Built-in scorers are ours and bounded (python_exec has its own subprocess timeout), so they are
  called directly.

Run its tests with ``python -m pytest tests/engine/data/test_rewards.py -q``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import re
import threading
import traceback
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

from rlflow.engine import progress
from rlflow.engine.data import task
from rlflow.engine.data.sandbox import run_python
from rlflow.engine.specs import load_function

log = logging.getLogger("rlflow.reward")

# An optional sign and dollar sign, digits with thousands commas, an optional decimal part.
# A trailing "." is not part of the number, so "$5." reads as 5.
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_PYTHON_BLOCK = re.compile(r"```python[^\n]*\n(.*?)```", re.DOTALL)


class ComputeScore(Protocol):
    """A reward function's shape (verl's): a score for one decoded response, or a dict holding
    "score" and other numbers to log (`reward/<key>/mean`)."""

    def __call__(self, data_source: str, solution_str: str, ground_truth: str,
                 extra_info: dict | None = None) -> float | dict[str, float]: ...


def _extract(text: str, method: str) -> float | None:
    if method == "strict":
        marker = text.rfind("####")
        found = _NUMBER.match(text[marker + 4:].lstrip()) if marker >= 0 else None
        numbers = [found.group(0)] if found else []
    elif method == "flexible":
        numbers = _NUMBER.findall(text)
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    return float(numbers[-1].replace("$", "").replace(",", "")) if numbers else None


def gsm8k_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                method: str = "strict") -> float:
    """1.0 when the extracted answer equals ``ground_truth`` numerically, else 0.0.

    strict: the number right after the last ``####``; flexible: the last number in the text.
    A ground truth that is a full GSM8K solution (contains ``####``) is reduced the strict way.
    """
    answer = _extract(solution_str, method)
    truth = _extract(ground_truth, "strict" if "####" in ground_truth else "flexible")
    if truth is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r} holds no number")
    return float(answer is not None and math.isclose(answer, truth, rel_tol=1e-9, abs_tol=1e-9))


def python_exec_score(data_source: str, solution_str: str, ground_truth: str,
                      extra_info: dict | None = None) -> float:
    """1.0 when the response's code followed by ``ground_truth`` (test code, e.g. asserts) exits 0.

    The code is the last ```python fenced block, or the whole response without one. It runs in a
    sandboxed subprocess (engine/data/sandbox.py) for at most ``extra_info["timeout_s"]`` (default 5) s;
    timeouts and crashes are the model's failures and score 0.0, not reward errors.
    """
    blocks = _PYTHON_BLOCK.findall(solution_str)
    code = blocks[-1] if blocks else solution_str
    timeout_s = float((extra_info or {}).get("timeout_s", 5.0))
    return float(run_python(f"{code}\n\n{ground_truth}\n", timeout_s).returncode == 0)


_BOXED = re.compile(r"\\boxed\s*\{")
# Light answer normalisation: spacing and sizing commands, degree, percent and dollar signs carry no value.
_MATH_DROP = re.compile(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\displaystyle|\\[!,;: $]|\^\{?\\circ\}?|\\?%|\s")
_MATH_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_NUM = r"\d+(?:\.\d+)?"
_MATH_FRACTION = re.compile(rf"(-?)\\frac\{{({_NUM})\}}\{{({_NUM})\}}|(-?)({_NUM})/({_NUM})")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, nested braces balanced; None without one.

    Escaped braces (``\\{``) do not count towards nesting. An unclosed last box gives None.
    """
    found = list(_BOXED.finditer(text))
    if not found:
        return None
    begin, depth = found[-1].end(), 0
    for i in range(begin, len(text)):
        if text[i] not in "{}" or text[i - 1] == "\\":
            continue
        if text[i] == "}" and depth == 0:
            return text[begin:i]
        depth += 1 if text[i] == "{" else -1
    return None


def _normalise_math(answer: str) -> str:
    text = _MATH_TEXT.sub(r"\1", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _MATH_DROP.sub("", text).strip("$").rstrip(".").strip("$")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)  # \frac12 shorthand
    return re.sub(r"^[a-zA-Z]=", "", text)  # "x=5" answers 5


def _math_number(text: str) -> Fraction | None:
    """Exact value of an integer, decimal, "a/b" or "\\frac{a}{b}" (optionally negative), else None."""
    match = _MATH_FRACTION.fullmatch(text)
    try:
        if match:
            sign, top, bottom = match[1] or match[4], match[2] or match[5], match[3] or match[6]
            value = Fraction(top) / Fraction(bottom)
            return -value if sign else value
        return Fraction(text.replace(",", "") if _THOUSANDS.fullmatch(text) else text)
    except (ValueError, ZeroDivisionError):
        return None


def math_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the last ``\\boxed{}`` of the response matches ``ground_truth``, else 0.0.

    Both sides are lightly normalised (spaces, surrounding $, \\left/\\right, trailing ".",
    \\dfrac/\\tfrac, a leading "x=") and compared as strings, then as exact numbers when both parse
    (integers, decimals, "a/b", "\\frac{a}{b}"). A response without a box scores 0.0. A ground truth
    that is a full solution (contains a box) is reduced to its last box.
    """
    boxed = last_boxed(solution_str)
    if boxed is None:
        return 0.0
    truth_box = last_boxed(ground_truth)
    truth = _normalise_math(ground_truth if truth_box is None else truth_box)
    if not truth:
        raise ValueError(f"math ground truth {ground_truth!r} holds no answer")
    answer = _normalise_math(boxed)
    if answer == truth:
        return 1.0
    answer_value, truth_value = _math_number(answer), _math_number(truth)
    return float(answer_value is not None and answer_value == truth_value)


BUILTIN: dict[str, Callable] = {task.DATA_SOURCE: task.compute_score, "openai/gsm8k": gsm8k_score,
                                 "gsm8k": gsm8k_score, "python_exec": python_exec_score,
                                 "math": math_score, "lighteval/MATH": math_score}


def _finite(value: Any, what: str) -> float:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r:.80}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} is {number}")
    return number


def _unpack(result: Any) -> tuple[float, dict[str, float]]:
    """(score, numeric extras) from a float or a dict result; raises on anything unusable."""
    if not isinstance(result, dict):
        return _finite(result, "reward"), {}
    if "score" not in result:
        raise KeyError(f"reward dict has no 'score' key (keys: {sorted(result)})")
    extras = {}
    for key, value in result.items():
        with contextlib.suppress(TypeError, ValueError):  # diagnostics: non-numeric ones are dropped
            extras[key] = _finite(value, key)
    extras.pop("score", None)
    return _finite(result["score"], "reward['score']"), extras


class RewardTimeout(TimeoutError):
    """A reward function call ran past its deadline; raised in the caller, the call itself goes on."""


class _Worker:
    """One daemon thread running the calls handed to it; abandoned, still stuck, after a timeout.

    Not signal.alarm: Ray may run us off the main thread. Not a ThreadPoolExecutor: it joins its
    threads at exit, so a stuck call would hang shutdown; a daemon thread does not. Each worker
    has its own outbox, so an abandoned call finishing late can never answer a later one. A stuck
    CPU-bound call keeps competing for the GIL for the rest of the process.
    """

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="rlflow-reward", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, args = self._inbox.get()
            try:
                self._outbox.put((True, fn(*args)))
            except BaseException as e:  # re-raised in the caller, as a direct call would
                self._outbox.put((False, e))
            progress.tick()

    def call(self, fn: Callable, args: tuple, timeout_s: float) -> Any:
        self._inbox.put((fn, args))
        try:
            ok, value = self._outbox.get(timeout=timeout_s)
        except queue.Empty:
            raise RewardTimeout(f"timed out after {timeout_s:g}s") from None
        if not ok:
            raise value
        return value


def _user_line(e: BaseException) -> str:
    """ " (file:line)" of the last frame of `e` outside rlflow (the user's function), else ""."""
    ours = str(Path(__file__).parents[1])
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(ours)]
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


class RewardError(RuntimeError):
    """The reward function failed on a sample, with reward.on_error=raise: the run stops."""


class RewardFunction:
    """Scores a batch with the configured function, or the built-in scorer per data_source.

    One batch at a time: calls from several threads at once would share one worker.
    """

    def __init__(self, spec: str = "", on_error: str = "zero", timeout_s: float = 30.0) -> None:
        if on_error not in ("zero", "raise"):
            raise ValueError(f"on_error must be 'zero' or 'raise', got {on_error!r}")
        self.spec, self.on_error, self.timeout_s = spec, on_error, timeout_s
        self._fn = load_function(spec) if spec else None
        self._worker: _Worker | None = None  # started on first use, replaced after a timeout

    def __reduce__(self) -> tuple:
        # Rebuilt from the spec, so a Ray actor receiving it re-imports the function itself.
        return (RewardFunction, (self.spec, self.on_error, self.timeout_s))

    def _scorer(self, data_source: str) -> Callable:
        if self._fn is not None:
            return self._fn
        if data_source not in BUILTIN:
            raise ValueError(f"no built-in reward for data_source {data_source!r} (built-ins: "
                             f"{sorted(BUILTIN)}); set reward.function='package.module:function' "
                             "or 'path/to/file.py:function'")
        return BUILTIN[data_source]

    def _call(self, fn: Callable, args: tuple) -> Any:
        if fn is not self._fn or self.timeout_s <= 0:  # built-ins cannot hang; <= 0 turns it off
            return fn(*args)
        if self._worker is None:
            self._worker = _Worker()
        try:
            return self._worker.call(fn, args, self.timeout_s)
        except RewardTimeout:
            self._worker = None  # leave the stuck thread behind; the next call gets a fresh one
            raise

    def __call__(self, data_sources: list[str], solutions: list[str], ground_truths: list[str],
                 extra_infos: list[dict | None]) -> tuple[list[float], dict[str, float], list[dict]]:
        """(scores [N], metrics, extras [N]) for N decoded responses."""
        if not len(data_sources) == len(solutions) == len(ground_truths) == len(extra_infos):
            raise ValueError("data_sources, solutions, ground_truths and extra_infos differ in length")
        scores, extras, failures, timeouts = [], [], [], 0
        for i, (src, sol, gt, info) in enumerate(zip(data_sources, solutions, ground_truths, extra_infos)):
            fn = self._scorer(src)
            try:
                score, extra = _unpack(self._call(fn, (src, sol, gt, info)))
            except Exception as e:
                failure = f"sample {i} (data_source={src!r}): {type(e).__name__}: {e}"
                if self.on_error == "raise":
                    raise RewardError(f"reward function failed on {failure}{_user_line(e)}") from e
                failures.append(failure)
                timeouts += isinstance(e, RewardTimeout)
                score, extra = 0.0, {}
            scores.append(score)
            extras.append(extra)
        if failures:
            log.warning("reward failed on %d/%d samples (scored 0.0); first: %s",
                        len(failures), len(scores), failures[0])
        metrics = {"reward/errors": float(len(failures)), "reward/timeouts": float(timeouts),
                   "reward/error_rate": len(failures) / max(1, len(scores))}
        return scores, {**metrics, **_extra_means(extras)}, extras


def _extra_means(extras: list[dict[str, float]]) -> dict[str, float]:
    """reward/<key>/mean over the samples that reported <key>."""
    values: dict[str, list[float]] = {}
    for extra in extras:
        for key, value in extra.items():
            values.setdefault(key, []).append(value)
    return {f"reward/{key}/mean": sum(v) / len(v) for key, v in values.items()}
