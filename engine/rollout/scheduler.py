"""The native engine's scheduler: which sequences run, in which KV-cache slot, and when. Plain
Python, no torch: it decides, and the engine's model runner (engine/rollout/runner.py) carries out
on the device what each decision needs (the slots' inputs, K/V copies, prefill layouts).

Its rules, each a method:
- `take` queues requests: continued histories first (they hold a slot), then fresh ones shortest
  prompt first (a prefill step pads its prompts to the longest it holds) and, while they outnumber
  the slots, first samples first (each prompt is prefilled once, early, and its other samples copy
  it as slots free);
- `join` moves a request that continues an idle slot's history by at most FOLD tokens into that
  slot, its new tokens fed one a decode step, and a waiting sample of a prompt that a running
  sequence holds into a free slot, to copy that prompt's K/V: neither waits for a prefill step;
- `admit` takes waiting requests into free slots while their distinct prompts fit the prefill
  budget (a longer prompt comes alone and goes in chunk by chunk); serving, it waits until the
  waiting are 1/FRACTION of those running, or PATIENCE steps (`due`);
- `book` appends each step's token and retires finished sequences; `retire` frees their slots,
  keeping what each holds (`histories`), and while none wait plans moves of running sequences
  down to the lowest slots, so decode steps run over fewer rows.

Invariants:
- a slot is free or runs one sequence, never both; a free slot may be reserved for the waiting
  request that continues its history (`reserved` names free slots only);
- the schedule depends only on the requests, the order they came in and the histories kept, so
  the same calls give the same schedule.

Run: python -m pytest tests/engine/rollout/test_scheduler.py
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rlflow.engine.rollout.histories import Histories


@dataclass(slots=True)
class Seq:
    prompt: list[int]
    key: Any  # handed back with its completion
    sample: int = 0  # its index among its request's samples
    slot: int = -1
    cached: int = 0  # the prompt's first tokens already in the slot's cache (a continued sequence)
    limit: int = 0  # max new tokens
    feeding: list[int] = field(default_factory=list)  # prompt tokens still to go in through decode steps
    void: int = 0  # results of steps launched on a fed token that is not the prompt's last: dropped
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token, the weights version of its step
    finish: str = ""  # "" while running, then "stop" | "length"


# (from slot, to slot, the K/V columns to swap): a running sequence moved down as others retire
Move = tuple[int, int, int]


def row_sizes(max_slots: int) -> list[int]:
    """The row counts a decode step runs (on CUDA, one graph each): a step runs the smallest that
    covers the highest busy slot."""
    return sorted({b for b in (1, 2, 4, 8, 16, 32) if b < max_slots} | set(range(64, max_slots, 64)) | {max_slots})


class Scheduler:
    # serving, fresh requests that trickle in wait until they are 1/FRACTION of those running, or for
    # PATIENCE steps: each admission is a prefill step that holds every running sequence for one step
    FRACTION, PATIENCE = 8, 8
    # a continued sequence with at most FOLD new tokens takes them in through decode steps, one a step
    # beside the others' decoding (the decode graph's cost per row is small), instead of a prefill
    # step that holds every running sequence (its launches alone cost tens of ms on CUDA)
    FOLD = 64
    SORT = True  # whether fresh requests queue by prompt length (and sample); off only to measure it
    FAN = True  # whether waiting samples copy a running sibling's prompt (`join`); off only to measure it
    MOVE = True  # whether running sequences move down as others retire; off only to measure it

    def __init__(self, max_slots: int, max_len: int, max_prefill_tokens: int) -> None:
        self.max_slots, self.max_len, self.max_prefill_tokens = max_slots, max_len, max_prefill_tokens
        self.row_sizes = row_sizes(max_slots)
        self.histories = Histories()  # what each idle slot's cache still holds
        self.prefilled = self.reused = 0  # prompt tokens run through the model, and found cached instead
        self.fanned = 0  # samples that copied a running sibling's prompt instead of a prefill
        self.moved = 0  # sequences moved to a lower slot mid-decode
        self.start(spare=False)

    def start(self, spare: bool) -> None:
        """A call begins: every slot free, nothing waiting or running. With `spare` (serving), a free
        slot that holds no history goes before one that does, and admissions are gathered (`due`)."""
        self.spare = spare
        self.waiting: deque[Seq] = deque()
        # the end goes first: slot 0, then a slot just retired, so busy slots stay low (decode runs
        # rows 0..the highest busy one) and a call's schedule does not depend on the histories kept
        self.free = list(range(self.max_slots - 1, -1, -1))
        self.reserved: dict[int, Seq] = {}  # slot -> the waiting sequence that continues its history
        self.running: list[Seq] = []
        self.stalled = 0  # steps since requests last were admitted, while some wait

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running)

    def rows_for(self, busy: int) -> int:
        """The row count a decode over slots 0..busy-1 runs."""
        return next(b for b in self.row_sizes if b >= busy)

    def take(self, requests: Iterable[Any] | None, max_new_tokens: int) -> bool:
        """Queue `requests` (base.Request: a request's samples share one prompt list, so one
        prefill); False for None, once no more will come."""
        if requests is None:
            return False
        seqs = []
        for r in requests:
            limit = r.limit or max_new_tokens
            if not r.prompt or len(r.prompt) + limit > self.max_len:
                raise ValueError(f"a request of {len(r.prompt)} prompt tokens and {limit} new ones does not fit "
                                 f"max_len={self.max_len} (or its prompt is empty)")
            seqs += [Seq(r.prompt, key, j, limit=limit) for j, key in enumerate(r.keys)]
        continuing = self._reserve(seqs)  # to the front: fresh prompts must not take their slots
        self.waiting.extendleft(reversed(continuing))
        fresh = [s for s in seqs if self.reserved.get(s.slot) is not s]
        if self.SORT:
            scarce = len(self.waiting) + len(fresh) > self.max_slots
            fresh.sort(key=lambda s: (s.sample if scarce else 0, len(s.prompt)))
        self.waiting.extend(fresh)
        return True

    def join(self) -> tuple[list[Seq], list[tuple[Seq, int]]]:
        """Move waiting sequences into free slots to join the decode steps, without a prefill step
        (which holds every running sequence): those that continue an idle slot's history by at most
        FOLD tokens, into that slot; and samples of a prompt that a running sequence holds, each
        paired with that sequence's slot, to copy the K/V of the prompt but its last token. So while
        slots are scarce a prompt is prefilled once, not once a sample. The new tokens of both are
        fed by the decode steps they join (`fed`)."""
        continued, copies = self._continued(), self._fan_out()
        joined = continued + [s for s, _ in copies]
        for s in joined:
            self.histories.forget(s.slot)
            s.feeding = s.prompt[s.cached:]
        self.prefilled += sum(len(s.feeding) for s in joined)
        self.reused += sum(s.cached for s in joined)
        self.running = self.running + joined  # a new list: a step launched ahead holds the old one
        return continued, copies

    def _continued(self) -> list[Seq]:
        joined = [s for s in self.reserved.values() if len(s.prompt) - s.cached <= self.FOLD]
        if not joined:
            return []
        taken = {id(s) for s in joined}
        kept = [s for s in self.waiting if id(s) not in taken]
        self.waiting.clear()
        self.waiting.extend(kept)
        for s in joined:
            del self.reserved[s.slot]
            self.free.remove(s.slot)
        return joined

    def _fan_out(self) -> list[tuple[Seq, int]]:
        if not (self.free and self.waiting and self.FAN):
            return []
        # a holder has the prompt's K/V but its last token in; a one-token prompt has none to copy (and a
        # row at 0 cached tokens is idle to the decode graphs, which would not count its tokens)
        holders = {id(s.prompt): s for s in self.running if len(s.feeding) <= 1 and len(s.prompt) > 1}
        if not holders:
            return []
        room = sum(f not in self.reserved for f in self.free)  # slots kept for a continued history stay theirs
        joined: list[Seq] = []
        passed: list[Seq] = []  # back to the queue's front, in order
        while self.waiting and len(joined) < room:  # samples of held prompts queue early: few are passed
            s = self.waiting.popleft()
            (joined if id(s.prompt) in holders and self.reserved.get(s.slot) is not s else passed).append(s)
        self.waiting.extendleft(reversed(passed))
        for s in joined:
            s.slot = self._free_slot()
            self.free.remove(s.slot)
            s.cached = len(s.prompt) - 1
        self.fanned += len(joined)
        return [(s, holders[id(s.prompt)].slot) for s in joined]

    def due(self) -> bool:
        """Whether waiting requests should be admitted now (serving gathers them, see FRACTION)."""
        return bool(self.waiting and self.free) and (
            not self.spare or not self.running or self.stalled >= self.PATIENCE
            or len(self.waiting) * self.FRACTION >= len(self.running))

    def admit(self, now: bool) -> list[Seq]:
        """With `now`, move waiting requests into free slots while their distinct prompts fit the
        padded prefill-token budget; a prompt longer than the budget comes alone (its chunks
        alternate with the running sequences' decode steps). A prompt that continues what an idle
        slot holds takes that slot (`reserved` for it) and prefills only the rest; others take a
        free slot no waiting prompt continues, while there is one."""
        batch: list[Seq] = []
        prompts: set[int] = set()  # ids of the distinct prompt lists admitted (samples share one)
        width = 0
        while now and self.waiting and self.free:
            seq = self.waiting[0]
            cached = seq.cached if self.reserved.get(seq.slot) is seq else 0
            width = max(width, len(seq.prompt) - cached)
            if batch and len(prompts | {id(seq.prompt)}) * width > self.max_prefill_tokens:
                break
            if id(self.waiting.popleft().prompt) not in prompts:  # its prefill row: counted once
                prompts.add(id(seq.prompt))
                self.prefilled += len(seq.prompt) - cached
                self.reused += cached
            slot = seq.slot if cached else self._free_slot()
            evicted = self.reserved.pop(slot, None)
            if evicted is not None and evicted is not seq:  # no slot left but one a later prompt continues
                evicted.cached = 0
            self.free.remove(slot)
            self.histories.forget(slot)
            seq.slot, seq.cached = slot, cached
            batch.append(seq)
        self.stalled = 0 if batch or not self.waiting else self.stalled + 1
        return batch

    def fed(self, batch: list[Seq]) -> list[tuple[int, int]]:
        """Before a decode step over `batch`: (slot, next prompt token) of each sequence still being
        fed, its input this step; the step's sample for it is void unless that token is the
        prompt's last."""
        pairs = []
        for s in batch:
            if s.feeding:
                s.void += len(s.feeding) > 1
                pairs.append((s.slot, s.feeding.pop(0)))
        return pairs

    def book(self, stepped: list[Seq], tokens: list[int], logprobs: list[float], version: int | None,
             stopped: Callable[[Seq, int], bool]) -> list[Seq]:
        """Append a step's token, logprob and (unless None) weights version to each sequence it
        stepped (not to one retired before the step was read, nor for a fed prompt token); returns
        the sequences that finished: `stopped(seq, token)`, or at their limit."""
        if math.isnan(sum(logprobs)):  # NaN: sampling from it would be noise (a logprob is never +inf)
            raise FloatingPointError("the policy's logits are NaN: its weights hold non-finite values")
        retired: list[Seq] = []
        for seq, tok, lp in zip(stepped, tokens, logprobs):  # per sequence and step: kept lean
            if seq.finish:  # retired after a step launched ahead of it: that step's token is void
                continue
            if seq.void:  # the step fed a prompt token: its sample is the next prompt token's place
                seq.void -= 1
                continue
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            if version is not None:
                seq.versions.append(version)
            if stopped(seq, tok):
                seq.finish = "stop"
            elif len(seq.tokens) >= seq.limit:
                seq.finish = "length"
            else:
                continue
            retired.append(seq)
        return retired

    def retire(self, retired: list[Seq], entered: list[Seq]) -> list[Move]:
        """After a step: `entered` (whose prefill ended) run on, `retired` leave. Free the retired
        sequences' slots, keeping what each holds (the prompt and every sampled token but the last,
        whose K/V no decode wrote); while no request waits, return the moves that bring running
        sequences down into freed slots, each a swap of what the two slots hold, already booked."""
        self.running = [s for s in self.running + entered if not s.finish]
        for s in retired:
            self.histories.remember(s.slot, s.prompt + s.tokens[:-1])
            self.free.append(s.slot)
        return self._compact() if retired and self.running and not self.waiting and self.MOVE else []

    def forget(self) -> None:
        """The cache holds nothing a later prompt may continue (new weights, memory released)."""
        self.histories.forget()

    def _compact(self) -> list[Move]:
        """Move the running sequences above the row count that would cover them all into the lowest
        free slots (none reserved). Each mover swaps places with what its new slot holds, a kept
        history included, which goes on in the slot vacated. A pair swaps the columns its longer
        side holds (+ 2: a step in flight), rounded up to a power of 2; moves come by width, so that
        pairs of one width copy together and one long sequence does not widen every copy."""
        target = self.rows_for(len(self.running))
        movers = [s for s in self.running if s.slot >= target]
        room = sorted(f for f in self.free if f < target and f not in self.reserved)[:len(movers)]
        if not movers or len(room) < len(movers):
            return []
        widths = [min(self.max_len, 1 << (max(len(s.prompt) + len(s.tokens) + 2, len(self.histories.get(f))) - 1)
                      .bit_length()) for s, f in zip(movers, room)]
        pairs = sorted(zip(movers, room, widths), key=lambda m: m[2])
        moves = [(s.slot, f, width) for s, f, width in pairs]
        for s, slot, _ in pairs:  # a mover's own slot holds no history: it is running
            if slot in self.histories:
                history = self.histories.get(slot)
                self.histories.forget(slot)
                self.histories.remember(s.slot, history)
            self.free.remove(slot)
            self.free.insert(0, s.slot)  # taken last: admissions fill low slots first
            s.slot = slot
        self.moved += len(movers)
        return moves

    def _free_slot(self) -> int:
        """The free slot a fresh request takes: the last freed that no waiting request continues
        (serving, nor holds a history: its episode's next turn may still come), else the last."""
        unreserved = (s for s in reversed(self.free) if s not in self.reserved)
        if self.spare:
            unreserved = (s for s in reversed(self.free) if s not in self.reserved and s not in self.histories)
        return next(unreserved, next((s for s in reversed(self.free) if s not in self.reserved), self.free[-1]))

    def _reserve(self, seqs: list[Seq]) -> list[Seq]:
        """Reserve for each of `seqs` that continues an idle slot's history that slot, at most one
        request a slot (a prompt's other samples prefill it again from the first one's); returns
        those requests, which must wait ahead of the others."""
        found: list[Seq] = []
        matches = self.histories.continued([seq.prompt for seq in seqs]) if self.histories else []
        for seq, (slot, cached) in zip(seqs, matches):
            if slot >= 0 and slot not in self.reserved:
                self.reserved[slot], seq.slot, seq.cached = seq, slot, cached
                found.append(seq)
        return found
