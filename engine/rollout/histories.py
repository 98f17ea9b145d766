"""What the idle slots of the native engine's KV cache still hold, so that a prompt continuing one
(a multi-turn episode's next turn: history + sampled token + observation) prefills only what is new.

A history is the token ids whose K/V a slot holds. It is found by its length and its last TAIL ids,
then compared in full, so a lookup costs one dictionary probe per distinct kept length below the
prompt's.

Invariants:
- a slot holds at most one history, and an entry of the index always names a slot whose history it
  describes (two slots holding equal histories: the index names the last remembered);
- a match is a strict prefix of the prompt: the prompt's last token is always run, for its logits.

The engine decides when a history is stale (new weights, a slot taken); this only records.
"""

from __future__ import annotations

import bisect


class Histories:
    TAIL = 16  # ids of a history's end that index it

    def __init__(self) -> None:
        self.held: dict[int, list[int]] = {}  # slot -> the ids its K/V holds
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}  # (length, last TAIL ids) -> slot

    def __contains__(self, slot: int) -> bool:
        return slot in self.held

    def __bool__(self) -> bool:
        return bool(self.held)

    def get(self, slot: int) -> list[int]:
        """The ids `slot` holds; [] if none are known."""
        return self.held.get(slot, [])

    def remember(self, slot: int, history: list[int]) -> None:
        """Record that idle `slot` holds the K/V of `history`."""
        self.held[slot] = history
        self._index[self._key(history)] = slot

    def forget(self, slot: int | None = None) -> None:
        """Drop what `slot` (None: every slot) is known to hold."""
        for s in list(self.held) if slot is None else [slot]:
            history = self.held.pop(s, None)
            if history is not None and self._index.get(self._key(history)) == s:
                del self._index[self._key(history)]

    def continued(self, prompts: list[list[int]]) -> list[tuple[int, int]]:
        """For each prompt, (the slot whose history it continues, that history's length): the longest
        such history that is a strict prefix of it; (-1, 0) where none is."""
        lengths = sorted({n for n, _ in self._index})
        return [self._longest(p, lengths) for p in prompts]

    def _longest(self, prompt: list[int], lengths: list[int]) -> tuple[int, int]:
        for length in reversed(lengths[:bisect.bisect_left(lengths, len(prompt))]):
            slot = self._index.get((length, tuple(prompt[max(0, length - self.TAIL):length])), -1)
            if slot >= 0 and self.held[slot] == prompt[:length]:
                return slot, length
        return -1, 0

    def _key(self, history: list[int]) -> tuple[int, tuple[int, ...]]:
        return len(history), tuple(history[-self.TAIL:])
