"""Prompt datasets: verl-shaped rows in, templated token ids out, plus a resumable batch loader.

A row (parquet, jsonl or json) holds ``prompt`` (chat messages ``[{"role", "content"}]``, or a
plain string taken as one user message), ``data_source``, ``reward_model.ground_truth`` and an
optional ``extra_info`` dict.

Invariants:
- a prompt is never truncated: longer than ``max_prompt_tokens`` is skipped and counted
  (``overlong="skip"``) or an error naming the row (``overlong="error"``);
- every row is either kept or counted under exactly one skip reason, so
  ``rows == kept + overlong + malformed``;
- ``PromptLoader`` order is a pure function of (seed, epoch, position): saving and loading its
  ``state_dict`` resumes the exact batch sequence.

Run its tests with ``python -m pytest tests/engine/test_data.py -q``.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from engine import task

log = logging.getLogger("rlflow.data")
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


@dataclass
class Prompt:
    """One prompt, ready for rollout."""

    ids: list[int]  # [P] templated prompt tokens, P <= max_prompt_tokens
    data_source: str
    ground_truth: str
    extra_info: dict | None
    text: str  # the templated prompt, for sample tables


class _Skip(Exception):
    """A malformed row; the message is the reason, counted under ``malformed/<reason>``."""


def _text(value: Any, reason: str) -> str:
    if not isinstance(value, (str, bytes)):
        raise _Skip(reason)
    try:
        text = value.decode("utf-8") if isinstance(value, bytes) else value
        text.encode("utf-8")  # a str with lone surrogates (JSON escapes) would fail in the tokenizer
    except UnicodeError:
        raise _Skip("bad_text") from None
    return text


def _messages(prompt: Any) -> list[dict]:
    if isinstance(prompt, (str, bytes)):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list):
        raise _Skip("prompt_type")
    messages = []
    for message in prompt:
        if not isinstance(message, dict):
            raise _Skip("message_type")
        # Arrow fills fields missing from one message with None; templates test presence, so drop them.
        clean = {k: v for k, v in message.items() if v is not None}
        clean["role"] = _text(clean.get("role"), "message_role")
        clean["content"] = _text(clean.get("content"), "message_content")
        messages.append(clean)
    if not any(m["content"].strip() for m in messages):  # also catches an empty message list
        raise _Skip("empty_prompt")
    return messages


def _fields(row: dict) -> tuple[list[dict], str, str, dict | None]:
    messages = _messages(row.get("prompt"))
    data_source = _text(row.get("data_source"), "data_source")
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None:
        raise _Skip("missing_ground_truth")
    truth = _text(truth, "ground_truth") if isinstance(truth, bytes) else str(truth)
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise _Skip("extra_info_type")
    return messages, data_source, truth, extra_info


def read_rows(path: str) -> list[dict]:
    """The raw rows of one parquet/jsonl/json file, as dicts."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    fmt = FORMATS.get(Path(path).suffix)
    if fmt is None:
        raise ValueError(f"{path}: unsupported prompt file type; use one of {sorted(FORMATS)}")
    try:
        return datasets.load_dataset(fmt, data_files=path, split="train").to_list()
    except Exception as e:
        raise ValueError(f"could not read {path} as {fmt}: {e!r}") from e


def load_prompts(files: list[str], tokenizer: Any, max_prompt_tokens: int,
                 overlong: str = "skip") -> tuple[list[Prompt], dict[str, int]]:
    """Every usable row of ``files``, in file then row order, and counts of what was skipped."""
    if overlong not in ("skip", "error"):
        raise ValueError(f"overlong must be 'skip' or 'error', got {overlong!r}")
    counts: Counter[str] = Counter(rows=0, kept=0, overlong=0, malformed=0)
    prompts = []
    for path in map(str, files):
        for index, row in enumerate(read_rows(path)):
            counts["rows"] += 1
            try:
                messages, data_source, truth, extra_info = _fields(row)
            except _Skip as skip:
                counts.update(["malformed", f"malformed/{skip}"])
                continue
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template placed specials
            if len(ids) <= max_prompt_tokens:
                prompts.append(Prompt(list(ids), data_source, truth, extra_info, text))
            elif overlong == "skip":
                counts["overlong"] += 1
            else:
                raise ValueError(f"{path} row {index}: prompt is {len(ids)} tokens, over "
                                 f"max_prompt_tokens={max_prompt_tokens} (prompts are never truncated)")
    counts["kept"] = len(prompts)
    _summarise(files, dict(counts), max_prompt_tokens)
    return prompts, dict(counts)


def _summarise(files: list[str], counts: dict[str, int], max_prompt_tokens: int) -> None:
    skipped = counts["rows"] - counts["kept"]
    detail = ", ".join(f"{k}={v}" for k, v in counts.items() if k not in ("rows", "kept") and v)
    if not counts["kept"]:
        raise ValueError(f"no usable prompts in {files}: {counts} (overlong means > "
                         f"max_prompt_tokens={max_prompt_tokens}; malformed/<reason> names the bad field)")
    if skipped:
        log.warning("skipped %d of %d prompt rows in %s: %s", skipped, counts["rows"], files, detail)


class PromptLoader:
    """Endless batches of prompts, reshuffled each epoch, resumable from ``state_dict``.

    Each epoch is the permutation ``default_rng([seed, epoch])``; a batch takes the next
    ``batch_size`` positions. When fewer than ``batch_size`` remain, they are dropped and the
    batch starts the next epoch, so every batch is full and no batch spans two epochs.
    """

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not 0 < batch_size <= len(prompts):
            raise ValueError(f"batch_size={batch_size} must be in 1..{len(prompts)} (the number of prompts)")
        self.prompts, self.batch_size, self.seed, self.shuffle = prompts, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        # Recomputed per batch (cheap next to a rollout) so the state is three integers.
        if not self.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def next_batch(self) -> list[Prompt]:
        if self.position + self.batch_size > len(self.prompts):
            self.epoch, self.position = self.epoch + 1, 0
        picked = self._order(self.epoch)[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return [self.prompts[i] for i in picked]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if not 0 <= state["position"] <= len(self.prompts):
            raise ValueError(f"loader position {state['position']} is outside a {len(self.prompts)}-prompt "
                             "dataset; was it saved with different data?")
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])


def embedded_files(root: str | Path, seed: int) -> dict[str, str]:
    """The embedded task's {"train", "val"} parquet paths under ``root/data``, built if missing.

    Existing files are reused whatever seed wrote them: ``root`` is meant to be one run's directory.
    """
    out = Path(root) / "data"
    paths = {split: str(out / f"{split}.parquet") for split in ("train", "val")}
    if all(Path(p).is_file() for p in paths.values()):
        return paths
    return task.build_data(out, seed=seed)
