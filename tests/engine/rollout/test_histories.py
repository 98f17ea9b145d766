"""The native engine's record of what idle slots hold (engine/rollout/histories.py)."""

from rlflow.engine.rollout.histories import Histories


def test_a_prompt_continues_the_longest_history_that_is_a_strict_prefix_of_it():
    kept = Histories()
    short, long = list(range(5)), list(range(40))  # the long one's index key is its last 16 ids
    kept.remember(3, short)
    kept.remember(7, long)
    assert kept.continued([list(range(50)), list(range(10)), list(range(40)), [9, 9]]) == [
        (7, 40), (3, 5), (3, 5),  # the whole long history is no strict prefix of itself
        (-1, 0)]
    kept.remember(1, list(range(39)) + [99])  # same length and tail size as `long`, other ids
    assert kept.continued([list(range(50))]) == [(7, 40)]


def test_forgetting_a_slot_drops_its_history_and_no_other():
    kept = Histories()
    kept.remember(0, [1, 2, 3])
    kept.remember(1, [1, 2, 3, 4])
    kept.forget(1)
    assert 1 not in kept and kept.get(1) == []
    assert kept.continued([[1, 2, 3, 4, 5]]) == [(0, 3)]
    kept.remember(2, [1, 2, 3])  # the same history in a second slot: found there from now on
    kept.forget(0)
    assert kept.continued([[1, 2, 3, 4]]) == [(2, 3)]
    kept.forget()
    assert not kept and kept.continued([[1, 2, 3, 4]]) == [(-1, 0)]
