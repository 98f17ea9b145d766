"""The native engine's scheduler alone, on scripted requests: no model, no device. Each rule of
engine/rollout/scheduler.py: queueing, admission within the prefill budget, continued histories,
copied prompts, fed tokens, booking, retirement and moving running sequences down. The engine's
own tests (test_native.py) check that what it decides gives the tokens a whole forward gives."""

import subprocess
import sys

import pytest

from rlflow.engine.rollout.base import Request
from rlflow.engine.rollout.scheduler import Scheduler, Seq

NEVER = lambda seq, token: False  # noqa: E731  (no stop token: sequences end at their limit)


def admitted_running(sched: Scheduler, requests: list[Request], new: int = 4) -> list[Seq]:
    """Queue `requests`, admit them in one step, and let them run (as a prefill step would)."""
    sched.take(requests, new)
    batch = sched.admit(True)
    sched.retire([], batch)
    return batch


def finish(sched: Scheduler, seqs: list[Seq], tokens: list[int]) -> None:
    """Book `tokens` for each of `seqs` up to its limit, then retire them."""
    for s in seqs:
        s.limit = len(tokens)
    for t in tokens:
        retired = sched.book(seqs, [t] * len(seqs), [0.0] * len(seqs), None, NEVER)
    sched.retire(retired, [])


def check_slots(sched: Scheduler) -> None:
    busy = [s.slot for s in sched.running]
    assert len(set(busy)) == len(busy), busy
    assert not set(busy) & set(sched.free) and not set(busy) & set(sched.reserved), (busy, sched.free)
    assert set(sched.reserved) <= set(sched.free)
    assert sorted(busy + sched.free) == sorted(set(busy + sched.free)), "a slot is twice free"


def test_importing_the_scheduler_imports_no_torch():
    code = "import sys, rlflow.engine.rollout.scheduler; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_fresh_requests_queue_shortest_first_and_by_sample_while_slots_are_scarce():
    sched = Scheduler(max_slots=8, max_len=64, max_prefill_tokens=64)
    sched.take([Request([1] * 5, ["a"]), Request([2] * 2, ["b"]), Request([3] * 3, ["c"])], 4)
    assert [len(s.prompt) for s in sched.waiting] == [2, 3, 5]
    scarce = Scheduler(max_slots=3, max_len=64, max_prefill_tokens=64)
    scarce.take([Request([1] * 5, ["a0", "a1"]), Request([2] * 2, ["b0", "b1"])], 4)
    assert [s.key for s in scarce.waiting] == ["b0", "a0", "b1", "a1"]  # 4 samples, 3 slots: first samples first
    fifo = Scheduler(max_slots=8, max_len=64, max_prefill_tokens=64)
    fifo.SORT = False
    fifo.take([Request([1] * 5, ["a"]), Request([2] * 2, ["b"])], 4)
    assert [s.key for s in fifo.waiting] == ["a", "b"]


def test_a_request_that_cannot_fit_is_refused():
    sched = Scheduler(max_slots=4, max_len=16, max_prefill_tokens=64)
    with pytest.raises(ValueError, match="max_len=16"):
        sched.take([Request([1] * 10, ["a"], limit=7)], 4)
    with pytest.raises(ValueError, match="empty"):
        sched.take([Request([], ["a"])], 4)
    assert sched.take(None, 4) is False


def test_a_prefill_step_holds_distinct_prompts_within_the_token_budget():
    sched = Scheduler(max_slots=16, max_len=64, max_prefill_tokens=16)
    sched.take([Request([i] * 4, [i]) for i in range(5)], 4)
    batch = sched.admit(True)
    assert [s.key for s in batch] == [0, 1, 2, 3] and [s.slot for s in batch] == [0, 1, 2, 3]  # 4 x 4 tokens
    assert sched.prefilled == 16 and [s.key for s in sched.waiting] == [4]
    # a prompt's samples share one prefill row: counted once against the budget
    shared = Scheduler(max_slots=16, max_len=64, max_prefill_tokens=16)
    shared.take([Request([7] * 6, ["s0", "s1", "s2"]), Request([8] * 8, ["t"])], 4)
    assert [s.key for s in shared.admit(True)] == ["s0", "s1", "s2", "t"] and shared.prefilled == 14
    # a prompt over the budget comes alone (it goes in chunk by chunk), and the next waits for it
    long = Scheduler(max_slots=16, max_len=64, max_prefill_tokens=16)
    long.take([Request([1] * 40, ["long"]), Request([2] * 45, ["longer"])], 4)
    assert [s.key for s in long.admit(True)] == ["long"] and [s.key for s in long.admit(True)] == ["longer"]
    assert long.admit(False) == [] and long.admit(True) == []


def test_serving_gathers_admissions_until_they_are_a_fraction_of_the_running_or_wait_long():
    sched = Scheduler(max_slots=32, max_len=64, max_prefill_tokens=4096)
    sched.start(spare=True)
    admitted_running(sched, [Request([i, i], [i]) for i in range(16)])
    sched.take([Request([99, 1], ["late"])], 4)
    steps = 0
    while not sched.due():  # 1 waiting x FRACTION 8 < 16 running: it waits, at most PATIENCE steps
        assert sched.admit(False) == []
        steps += 1
    assert steps == Scheduler.PATIENCE and [s.key for s in sched.admit(True)] == ["late"]
    sched.take([Request([98, 1], ["x"]), Request([97, 1], ["y"])], 4)
    assert sched.due()  # 2 waiting x 8 >= 16 running
    generating = Scheduler(max_slots=32, max_len=64, max_prefill_tokens=4096)  # not serving: admit at once
    admitted_running(generating, [Request([i, i], [i]) for i in range(16)])
    generating.take([Request([99, 1], ["late"])], 4)
    assert generating.due()


def test_a_continued_history_takes_its_slot_and_feeds_at_most_fold_new_tokens():
    sched = Scheduler(max_slots=4, max_len=64, max_prefill_tokens=64)
    [first] = admitted_running(sched, [Request([5, 6, 7], ["turn1"])])
    finish(sched, [first], [8, 9, 10])
    assert sched.histories.get(first.slot) == [5, 6, 7, 8, 9]  # all but the last token, whose K/V no decode wrote
    sched.take([Request([1, 2], ["other"]), Request([5, 6, 7, 8, 9, 10, 11, 12], ["turn2"])], 4)
    assert sched.reserved[first.slot].key == "turn2" and sched.waiting[0].key == "turn2"  # it goes first
    continued, copies = sched.join()
    assert [s.key for s in continued] == ["turn2"] and copies == []
    assert continued[0].slot == first.slot and continued[0].cached == 5 and continued[0].feeding == [10, 11, 12]
    assert first.slot not in sched.histories and sched.reused == 5
    check_slots(sched)
    # exactly FOLD new tokens still fold in
    edge = Scheduler(max_slots=4, max_len=64, max_prefill_tokens=64)
    edge.FOLD = 3
    [first] = admitted_running(edge, [Request([5, 6, 7], ["turn1"])])
    finish(edge, [first], [8, 9])
    edge.take([Request([5, 6, 7, 8, 9, 10, 11], ["turn2"])], 4)
    assert [s.key for s in edge.join()[0]] == ["turn2"]
    # more new tokens than FOLD: it waits for a prefill of the rest, in its own slot
    fold = Scheduler(max_slots=4, max_len=64, max_prefill_tokens=64)
    fold.FOLD = 2
    [first] = admitted_running(fold, [Request([5, 6, 7], ["turn1"])])
    finish(fold, [first], [8, 9])
    fold.take([Request([5, 6, 7, 8, 9, 10, 11], ["turn2"])], 4)
    assert fold.join() == ([], [])
    [again] = fold.admit(True)
    assert again.slot == first.slot and again.cached == 4 and fold.prefilled == 3 + 3 and fold.reused == 4


def test_waiting_samples_copy_a_running_siblings_prompt():
    sched = Scheduler(max_slots=2, max_len=64, max_prefill_tokens=64)
    prompt = [4, 5, 6, 7, 8]
    running = admitted_running(sched, [Request(prompt, ["s0", "s1", "s2"])])
    assert [s.key for s in running] == ["s0", "s1"] and sched.prefilled == 5
    finish(sched, [running[0]], [1])
    continued, copies = sched.join()
    [(copy, source)] = copies
    assert continued == [] and copy.key == "s2" and source == running[1].slot
    assert copy.slot == running[0].slot and copy.cached == 4 and copy.feeding == [8]
    assert sched.fanned == 1 and copy in sched.running
    check_slots(sched)
    off = Scheduler(max_slots=2, max_len=64, max_prefill_tokens=64)
    off.FAN = False
    running = admitted_running(off, [Request(prompt, ["s0", "s1", "s2"])])
    finish(off, [running[0]], [1])
    assert off.join() == ([], [])


def test_fed_prompt_tokens_void_their_samples_but_the_last():
    sched = Scheduler(max_slots=2, max_len=64, max_prefill_tokens=64)
    seq = Seq([1, 2, 3, 4], "k", slot=0, cached=1, limit=3, feeding=[2, 3, 4])
    sched.running = [seq]
    for fed, token in ((2, 50), (3, 51), (4, 52)):
        assert sched.fed([seq]) == [(0, fed)]
        sched.book([seq], [token], [-0.5], 7, NEVER)
    assert seq.tokens == [52] and seq.logprobs == [-0.5] and seq.versions == [7]
    assert sched.fed([seq]) == []


def test_booking_ends_a_sequence_at_a_stop_or_its_limit_and_refuses_nan():
    sched = Scheduler(max_slots=2, max_len=64, max_prefill_tokens=64)
    a, b = Seq([1], "a", slot=0, limit=5), Seq([1], "b", slot=1, limit=2)
    assert sched.book([a, b], [3, 3], [-1.0, -1.0], None, lambda s, t: t == 0) == []
    assert sched.book([a, b], [0, 4], [-1.0, -1.0], None, lambda s, t: t == 0) == [a, b]
    assert (a.finish, b.finish) == ("stop", "length") and a.versions == []
    assert sched.book([a], [9], [-1.0], None, NEVER) == [] and a.tokens == [3, 0]  # a retired sequence's token is void
    with pytest.raises(FloatingPointError, match="NaN"):
        sched.book([Seq([1], "c", limit=4)], [1], [float("nan")], None, NEVER)


def test_running_sequences_move_down_as_others_retire_and_take_kept_histories_along():
    sched = Scheduler(max_slots=16, max_len=64, max_prefill_tokens=64)
    seqs = admitted_running(sched, [Request([i, i + 1], [i]) for i in range(12)])
    assert [s.slot for s in seqs] == list(range(12))
    low, high = seqs[:8], seqs[8:]
    for s in low:
        s.limit = 1
    retired = sched.book(seqs, [3] * 12, [0.0] * 12, None, NEVER)
    assert retired == low
    moves = sched.retire(retired, [])
    # 4 running cover 4 rows: those in slots 8..11 go to the lowest free slots, swapping with the
    # histories there, and copy the columns either side holds, rounded up to a power of 2
    assert sorted((a, b) for a, b, _ in moves) == [(8, 0), (9, 1), (10, 2), (11, 3)]
    assert all(width == 8 for _, _, width in moves)  # 2 prompt tokens + 1 sampled + 2 in flight, to a power of 2
    assert [s.slot for s in high] == [0, 1, 2, 3] and sched.moved == 4
    assert [sched.histories.get(slot) for slot in (8, 9, 10, 11)] == [[i, i + 1] for i in range(4)]
    assert set(sched.free) == set(range(4, 16))
    check_slots(sched)
    [late] = admitted_running(sched, [Request([7, 7], ["late"])])
    assert late.slot == 7, "a slot vacated by a move went before the low free ones"
    still = Scheduler(max_slots=16, max_len=64, max_prefill_tokens=64)
    still.MOVE = False
    seqs = admitted_running(still, [Request([i, i + 1], [i]) for i in range(12)])
    for s in seqs[:8]:
        s.limit = 1
    assert still.retire(still.book(seqs, [3] * 12, [0.0] * 12, None, NEVER), []) == []


def test_nothing_moves_while_requests_wait_for_a_slot():
    sched = Scheduler(max_slots=16, max_len=64, max_prefill_tokens=64)
    seqs = admitted_running(sched, [Request([i, i + 1], [i]) for i in range(12)])
    sched.take([Request([1] * 30, ["waits"])], 4)
    for s in seqs[:8]:
        s.limit = 1
    assert sched.retire(sched.book(seqs, [3] * 12, [0.0] * 12, None, NEVER), []) == []


def test_serving_takes_a_free_slot_that_holds_no_history_first():
    sched = Scheduler(max_slots=3, max_len=64, max_prefill_tokens=64)
    sched.start(spare=True)
    [first] = admitted_running(sched, [Request([5, 6], ["turn1"])])
    finish(sched, [first], [7, 8])
    [other] = admitted_running(sched, [Request([1, 2], ["other"])])
    assert other.slot != first.slot and first.slot in sched.histories


def test_a_scripted_run_keeps_slots_apart_and_ends_every_request():
    """Requests of mixed lengths, samples and limits through the engine's step order with fewer
    slots than sequences, some continuing earlier ones: every sequence ends at its limit."""
    sched = Scheduler(max_slots=6, max_len=128, max_prefill_tokens=24)
    feeds = [[Request([i] * (3 + 5 * i), [(i, j) for j in range(3)], limit=2 + i) for i in range(4)],
             [Request([9] * 40, [("long", 0)], limit=3)], None]
    ended: dict = {}
    more, steps = True, 0
    while True:
        if more:
            more = sched.take(feeds.pop(0) if feeds else None, 8)
        if sched.idle:
            if more:
                continue
            break
        sched.join()
        entered = sched.admit(sched.due())
        stepped = entered or sched.running
        if not entered:
            sched.fed(stepped)
        retired = sched.book(stepped, [1] * len(stepped), [0.0] * len(stepped), None, NEVER)
        ended.update((s.key, len(s.tokens)) for s in retired)
        sched.retire(retired, entered)
        check_slots(sched)
        steps += 1
        assert steps < 500
    assert ended == {**{(i, j): 2 + i for i in range(4) for j in range(3)}, ("long", 0): 3}
    assert sched.fanned > 0 and sorted(sched.free) == list(range(6))
