"""The reward both frameworks optimise in `bench/e2e.py`: one plain function and the two thin
adapters each framework's API calls. Cheap on purpose (the benchmark times the step, not the
scorer), and it varies within a group, so advantages and gradients are not zero.

rlflow loads it by path (`reward.function=bench/e2e_reward.py:rlflow_score`), TRL gets
`trl_reward` as a reward function. Imports nothing, so rlflow's reward worker loads it as is.
"""

from __future__ import annotations


def score(text: str) -> float:
    """Fraction of the response's words that end in a character with an even code point."""
    words = text.split()
    return sum(ord(w[-1]) % 2 == 0 for w in words) / max(1, len(words))


def rlflow_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    return score(solution_str)


def trl_reward(completions: list[str], **kwargs) -> list[float]:
    return [score(c) for c in completions]
