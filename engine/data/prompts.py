"""Prompt datasets: verl-shaped rows in, templated token ids out, plus a resumable batch loader.

A prompt row (parquet, jsonl or json) holds ``prompt`` (chat messages ``[{"role", "content"}]``, or a
plain string taken as one user message), ``data_source``, ``reward_model.ground_truth`` and an
optional ``extra_info`` dict. A preference row (``load_pairs``, for DPO) holds ``prompt``,
``chosen``, ``rejected`` (strings, or TRL's conversational form: chat messages, the prompt
implicit in their shared turns) and an optional ``data_source``. A supervised row (``load_examples``,
for SFT) holds ``messages`` (a conversation), or ``prompt`` and ``response`` or ``completion``
(a string or chat turns), or is a prompt row whose ground truth is the response.

Invariants:
- a prompt (or an answer, or a response) is never truncated: over its token budget is skipped and counted
  (``overlong="skip"``) or an error naming the row (``overlong="error"``);
- every row is either kept or counted under exactly one skip reason, so
  ``rows == kept + overlong + malformed`` (a jsonl line that is not a JSON object is a row,
  ``malformed/bad_json``, and the warning names its line); a file that cannot be read at all, or an
  ``overlong="error"`` row, raises ``DataError``, one line naming the file;
- ``PromptLoader`` order is a pure function of (seed, epoch, position): saving and loading its
  ``state_dict`` resumes the exact batch sequence.

Run its tests with ``python -m pytest tests/engine/data/test_data.py -q``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
import torch

from rlflow.engine.batch import Batch
from rlflow.engine.data import task

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


class DataError(ValueError):
    """Data rlflow cannot use, said in one line naming the file (and row); the CLI prints it without a traceback."""


def read_rows(path: str, bad_lines: list[int] | None = None, lines: list[int] | None = None) -> list[dict]:
    """The raw rows of one parquet/jsonl/json file, as dicts. A jsonl line that is not a JSON object
    is skipped and its (1-based) number appended to `bad_lines`, and each kept row's number to `lines`
    (left empty for parquet/json); a file that cannot be read raises DataError."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    fmt = FORMATS.get(Path(path).suffix)
    if fmt is None:
        raise DataError(f"{path}: unsupported prompt file type; use one of {sorted(FORMATS)}")
    if Path(path).suffix == ".jsonl":
        return _read_jsonl(path, [] if bad_lines is None else bad_lines, [] if lines is None else lines)
    import datasets  # here, not at the top: a stage worker unpickling its first Prompt would import it (0.5 s)

    library_log = logging.getLogger("datasets")
    level = library_log.level
    library_log.setLevel(logging.CRITICAL)  # datasets logs its own copy of the error DataError reports
    try:
        return datasets.load_dataset(fmt, data_files=path, split="train").to_list()
    except Exception as e:  # datasets and Arrow raise many kinds; each means the file is unreadable
        root: BaseException = e
        while (inner := root.__cause__ or root.__context__) is not None:  # the innermost error names the problem
            root = inner
        why = (str(root).strip().splitlines() or [""])[0]
        raise DataError(f"could not read {path} as {fmt}: {type(root).__name__}: {why}") from e
    finally:
        library_log.setLevel(level)


def _read_jsonl(path: str, bad_lines: list[int], lines: list[int]) -> list[dict]:
    """Line by line, so one bad line costs that row, not the file; blank lines are ignored."""
    rows = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # bad JSON or UTF-8; nesting deeper than Python's stack
                row = None
            if isinstance(row, dict):
                rows.append(row)
                lines.append(number)
            else:
                bad_lines.append(number)
    return rows


class _Overlong(Exception):
    """A row over a token budget; the message says which part and by how much."""


def _load(files: list[str], make: Any, overlong: str, what: str) -> tuple[list, dict[str, int]]:
    """``make(row)`` over every row of ``files``, counting the rows it skips and why."""
    if overlong not in ("skip", "error"):
        raise ValueError(f"overlong must be 'skip' or 'error', got {overlong!r}")
    counts: Counter[str] = Counter(rows=0, kept=0, overlong=0, malformed=0)
    items = []
    bad_lines: dict[str, list[int]] = {}
    for path in map(str, files):
        bad = bad_lines[path] = []
        lines: list[int] = []  # jsonl: each row's line in the file
        rows = read_rows(path, bad, lines)
        if bad:  # a line that is not a JSON object is a row too, a malformed one
            counts.update({"rows": len(bad), "malformed": len(bad), "malformed/bad_json": len(bad)})
        for index, row in enumerate(rows):
            counts["rows"] += 1
            try:
                items.append(make(row))
            except _Skip as skip:
                counts.update(["malformed", f"malformed/{skip}"])
            except _Overlong as e:
                if overlong == "error":  # jsonl: the line in the file, as blank and bad lines are not rows
                    where = f"{path}:{lines[index]}" if lines else f"{path} row {index} (0-based)"
                    raise DataError(f"{where}: {e} ({what}s are never truncated)") from None
                counts["overlong"] += 1
    counts["kept"] = len(items)
    _summarise(files, dict(counts), what, bad_lines)
    return items, dict(counts)


def _prompt_ids(tokenizer: Any, messages: list[dict], max_prompt_tokens: int,
                tools: list[dict] | None = None) -> tuple[list[int], str]:
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template placed specials
    if len(ids) > max_prompt_tokens:
        raise _Overlong(f"prompt is {len(ids)} tokens, over max_prompt_tokens={max_prompt_tokens}")
    return list(ids), text


def load_prompts(files: list[str], tokenizer: Any, max_prompt_tokens: int, overlong: str = "skip",
                 tools: list[dict] | None = None) -> tuple[list[Prompt], dict[str, int]]:
    """Every usable row of ``files``, in file then row order, and counts of what was skipped; `tools`
    (JSON-schema function descriptions) are offered through the chat template."""
    def make(row: dict) -> Prompt:
        messages, data_source, truth, extra_info = _fields(row)
        ids, text = _prompt_ids(tokenizer, messages, max_prompt_tokens, tools)
        return Prompt(ids, data_source, truth, extra_info, text)

    return _load(files, make, overlong, "prompt")


def _answer(tokenizer: Any, text: str, key: str, max_response_tokens: int) -> list[int]:
    """The response tokens of `text`, with eos; never truncated."""
    if not text.strip():
        raise _Skip(f"empty_{key}")
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    if len(ids) > max_response_tokens:
        raise _Overlong(f"{key} is {len(ids)} tokens with eos, over max_response_tokens={max_response_tokens}")
    return ids


@dataclass
class Pair:
    """One preference pair, ready for DPO: a prompt and two answers, the first preferred."""

    prompt: list[int]  # [P] templated prompt tokens, P <= max_prompt_tokens
    chosen: list[int]  # [C] response tokens ending in eos, C <= max_response_tokens
    rejected: list[int]  # [J] likewise
    data_source: str
    text: str  # the templated prompt


def load_pairs(files: list[str], tokenizer: Any, max_prompt_tokens: int, max_response_tokens: int,
               overlong: str = "skip") -> tuple[list[Pair], dict[str, int]]:
    """Rows with ``prompt`` (chat messages or a string), ``chosen`` and ``rejected`` and an optional
    ``data_source``, as Pairs. The answers are strings, or TRL's conversational form: each a list of
    chat messages ending in the assistant's answer, the prompt either given or the turns both share.
    Skips are counted like ``load_prompts``'s, and a pair whose answers are the same text is
    malformed (``same_answer``)."""
    def make(row: dict) -> Pair:
        messages, chosen_text, rejected_text = _preference(row)
        source = row.get("data_source")
        source = "preference" if source is None else _text(source, "data_source")
        if chosen_text.strip() == rejected_text.strip():
            raise _Skip("same_answer")
        chosen, rejected = (_answer(tokenizer, text, k, max_response_tokens)
                            for k, text in (("chosen", chosen_text), ("rejected", rejected_text)))
        ids, text = _prompt_ids(tokenizer, messages, max_prompt_tokens)
        return Pair(ids, chosen, rejected, source, text)

    return _load(files, make, overlong, "pair")


def _preference(row: dict) -> tuple[list[dict], str, str]:
    """(prompt messages, chosen text, rejected text) of a preference row, plain or conversational."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if not isinstance(chosen, (list, np.ndarray)):  # plain: the answers are the texts
        return _messages(row.get("prompt")), _text(chosen, "chosen"), _text(rejected, "rejected")
    if not isinstance(rejected, (list, np.ndarray)):
        raise _Skip("rejected_type")
    chosen, rejected = _messages(list(chosen)), _messages(list(rejected))
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        raise _Skip("answer_not_assistant")
    if row.get("prompt") is not None:  # explicit prompt: each answer is one assistant turn
        if len(chosen) != 1 or len(rejected) != 1:
            raise _Skip("answer_turns")
        return _messages(row["prompt"]), chosen[0]["content"], rejected[0]["content"]
    if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:  # implicit prompt: the turns both share
        raise _Skip("no_shared_prompt")
    return chosen[:-1], chosen[-1]["content"], rejected[-1]["content"]


class Example(NamedTuple):
    prompt: list[int]  # [P] templated prompt tokens
    response: list[int]  # [R] response tokens, each assistant turn ending in eos
    trained: list[float] | None = None  # [R] 1 on assistant tokens, 0 on tool/user turns; None: all 1


def load_examples(files: list[str], tokenizer: Any, max_prompt_tokens: int, max_response_tokens: int,
                  overlong: str = "skip", tools: list[dict] | None = None) -> tuple[list[Example], dict[str, int]]:
    """Supervised examples, from rows of one of these shapes (TRL's among them):
    - ``messages``: a conversation; the turns before the first assistant turn are the prompt, and
      the rest a demonstration (below);
    - ``prompt`` and ``response`` or ``completion``: a string, or a demonstration's chat messages:
      assistant turns, trained on, and tool or user turns between them, rendered by the chat
      template with `tools` offered and not trained on;
    - a prompt row whose ``reward_model.ground_truth`` is the response.
    eos ends each assistant turn. Skips are counted like ``load_prompts``'s."""
    def make(row: dict) -> Example:
        if row.get("data_source") is not None:
            _text(row["data_source"], "data_source")
        if row.get("messages") is not None:
            return _conversation(row["messages"])
        messages = _messages(row.get("prompt"))
        text = row.get("response") if row.get("response") is not None else row.get("completion")
        if isinstance(text, (list, np.ndarray)):  # a multi-turn demonstration
            return _demonstration(tokenizer, messages, _messages(list(text)), tools, max_prompt_tokens,
                                  max_response_tokens)
        if text is None:  # a prompt row: its ground truth is the whole answer
            reward_model = row.get("reward_model")
            text = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
            if text is None:
                raise _Skip("no_response_or_ground_truth")
            text = text if isinstance(text, (str, bytes)) else str(text)
        response = _answer(tokenizer, _text(text, "response"), "response", max_response_tokens)
        return Example(_prompt_ids(tokenizer, messages, max_prompt_tokens, tools)[0], response)

    def _conversation(value: Any) -> Example:
        turns = _messages(list(value) if isinstance(value, (list, np.ndarray)) else value)
        first = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), None)
        if first is None:
            raise _Skip("no_assistant_turn")
        if first == 0:
            raise _Skip("no_prompt")
        return _demonstration(tokenizer, turns[:first], turns[first:], tools, max_prompt_tokens, max_response_tokens)

    return _load(files, make, overlong, "example")


def _demonstration(tokenizer: Any, prompt: list[dict], turns: list[dict], tools: list[dict] | None,
                   max_prompt_tokens: int, max_response_tokens: int) -> Example:
    """A multi-turn example as an episode holds it (engine/agents/episodes.py): each assistant turn
    its content's tokens and eos, trained; the turns between, rendered as observations, not."""
    render = Renderer(tokenizer, tools)
    ids: list[int] = []
    trained: list[float] = []
    i = 0
    while i < len(turns):
        if turns[i]["role"] == "assistant":
            part = tokenizer.encode(turns[i]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
            ids, trained, i = ids + part, trained + [1.0] * len(part), i + 1
            continue
        j = next((k for k in range(i, len(turns)) if turns[k]["role"] == "assistant"), len(turns))
        part = render(turns[i:j], ended=True)
        ids, trained, i = ids + part, trained + [0.0] * len(part), j
    if not any(trained):
        raise _Skip("no_assistant_turn")
    if len(ids) > max_response_tokens:
        raise _Overlong(f"demonstration is {len(ids)} tokens, over its budget of {max_response_tokens}")
    return Example(_prompt_ids(tokenizer, prompt, max_prompt_tokens, tools)[0], ids, trained)


class Renderer:
    """Observations as token ids: chat messages rendered by the tokenizer's template as they would
    follow an assistant turn (with the tools offered), then encoded once."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None) -> None:
        self.tokenizer, self.tools = tokenizer, tools or None
        self.base = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        self.head = tokenizer.apply_chat_template(self.base, tools=self.tools, tokenize=False)
        eos = tokenizer.eos_token or ""
        end = self.head.rfind(eos) if eos else -1
        self.after_eos = self.head[end + len(eos):] if end >= 0 else ""  # what the template puts after a turn's end

    def __call__(self, messages: list[dict], ended: bool) -> list[int]:
        """The ids of `messages` after a model turn that `ended` with eos (else eos comes first)."""
        full = self.tokenizer.apply_chat_template(self.base + messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=True)
        if not full.startswith(self.head):
            raise ValueError("the chat template renders a conversation's start differently once more turns "
                             "follow; observations cannot be appended as ids")
        text = ("" if ended else self.tokenizer.eos_token or "") + self.after_eos + full[len(self.head):]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def pairs_batch(pairs: list[Pair], pad_id: int) -> Batch:
    """2B rows, each pair's chosen answer right before its rejected one (group_size 2)."""
    batch = _rows([p.prompt for p in pairs for _ in range(2)], [r for p in pairs for r in (p.chosen, p.rejected)],
                  pad_id, 2)
    batch.data_source = [p.data_source for p in pairs for _ in range(2)]
    batch.prompt_text = [p.text for p in pairs for _ in range(2)]
    return batch


def examples_batch(examples: list[Example], pad_id: int) -> Batch:
    """One row per supervised example (group_size 1); a demonstration's tool and user turns have
    loss mask 0."""
    batch = _rows([e.prompt for e in examples], [e.response for e in examples], pad_id, 1)
    if any(e.trained is not None for e in examples):
        batch.loss_mask = torch.zeros_like(batch.response_mask)
        for i, e in enumerate(examples):
            batch.loss_mask[i, :len(e.response)] = torch.tensor(e.trained or [1.0] * len(e.response))
    return batch


def _rows(prompts: list[list[int]], answers: list[list[int]], pad_id: int, group_size: int) -> Batch:
    """Prompt -> answer rows as the stages' Batch holds them: prompts left-padded, answers right-padded."""
    pids = torch.full((len(prompts), max(len(p) for p in prompts)), pad_id, dtype=torch.long)  # [N, P]
    pmask = torch.zeros(pids.shape, dtype=torch.long)
    rids = torch.full((len(answers), max(len(r) for r in answers)), pad_id, dtype=torch.long)  # [N, R]
    rmask = torch.zeros(rids.shape, dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, answers)):
        pids[i, pids.shape[1] - len(p):], pmask[i, pids.shape[1] - len(p):] = torch.tensor(p), 1
        rids[i, :len(r)], rmask[i, :len(r)] = torch.tensor(r), 1.0
    n = len(prompts)
    return Batch(pids, pmask, group_size, [""] * n, [""] * n, [None] * n, response_ids=rids, response_mask=rmask)


def _summarise(files: list[str], counts: dict[str, int], what: str, bad_lines: dict[str, list[int]]) -> None:
    skipped = counts["rows"] - counts["kept"]
    detail = ", ".join(f"{k}={v}" for k, v in counts.items() if k not in ("rows", "kept") and v)
    # The first few jsonl lines that are not JSON objects, as file:line, so they can be found and fixed.
    lines = [f"{path}:{n}" for path, numbers in bad_lines.items() for n in numbers]
    where = f" (bad_json at {', '.join(lines[:5])}{', ...' if len(lines) > 5 else ''})" if lines else ""
    if not counts["kept"]:
        raise DataError(f"no usable {what}s in {files}: {counts}{where} (overlong means over a token budget; "
                        "malformed/<reason> names the bad field)")
    message = f"skipped {skipped} of {counts['rows']} {what} rows in {files}: {detail}{where}"
    if skipped and message not in _SAID:  # the warm start and RL read one file: said once
        _SAID.add(message)
        log.warning(message)


_SAID: set[str] = set()  # skip summaries already logged by this process


T = TypeVar("T")


class PromptLoader(Generic[T]):
    """Endless batches of prompts (or pairs), reshuffled each epoch, resumable from ``state_dict``.

    Each epoch is the permutation ``default_rng([seed, epoch])``; a batch takes the next
    ``batch_size`` positions. When fewer than ``batch_size`` remain, they are dropped and the
    batch starts the next epoch, so every batch is full and no batch spans two epochs.
    """

    def __init__(self, prompts: list[T], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not 0 < batch_size <= len(prompts):
            raise ValueError(f"batch_size={batch_size} must be in 1..{len(prompts)} (the number of prompts)")
        self.prompts, self.batch_size, self.seed, self.shuffle = prompts, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        # Recomputed per batch (cheap next to a rollout) so the state is three integers.
        if not self.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def next_batch(self) -> list[T]:
        if self.position + self.batch_size > len(self.prompts):
            self.epoch, self.position = self.epoch + 1, 0
        picked = self._order(self.epoch)[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return [self.prompts[i] for i in picked]

    def peek_batch(self, skip: int = 0) -> list[T]:
        """The batch `next_batch` will return after `skip` more calls, without moving past any."""
        state = self.state_dict()
        for _ in range(skip):
            self.next_batch()
        batch = self.next_batch()
        self.load_state_dict(state)
        return batch

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


def embedded_pair_files(root: str | Path, seed: int) -> dict[str, str]:
    """The embedded task's preference pairs, {"train", "val"} under ``root/pairs``, built if missing."""
    out = Path(root) / "pairs"
    paths = {split: str(out / f"{split}.parquet") for split in ("train", "val")}
    if all(Path(p).is_file() for p in paths.values()):
        return paths
    return task.build_pairs(out, seed=seed)
