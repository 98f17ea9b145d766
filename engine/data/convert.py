"""Raw GSM8K / MATH files in, verl-shaped prompt files out, ready for ``engine.data.prompts.load_prompts``;
with no file given, their Hub datasets (``HUB``), fetched into the HF cache (``fetch``).

A written row holds ``data_source``, ``prompt`` (one user message: the question plus an
instruction), ``ability`` ("math"), ``reward_model`` ({"style": "rule", "ground_truth"}) and
``extra_info`` ({"split", "index"} plus the source row's text fields; ``index`` is the row's
position in ``src``).

Inputs (.jsonl, .json or .parquet):
- gsm8k: {"question", "answer"}, the answer ending in "#### <number>"; the ground truth is that
  number without thousands commas;
- math: {"problem", "solution"} and optionally "level", "type", "subject"; the ground truth is the
  content of the solution's last \\boxed{...}, or the row's own "answer" field when it has one.

Invariants:
- every source row is either written or counted under exactly one skip reason, so
  ``rows == written + skipped`` and ``skipped`` is the sum of the ``skipped/<reason>`` counts;
- ``dst`` is never left partial: rows go to a temporary file beside it, moved into place by
  ``os.replace`` only once all are written.

Run its tests with ``python -m pytest tests/engine/data/test_convert.py -q``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlflow.engine import hub
from rlflow.engine.data.rewards import last_boxed

log = logging.getLogger("rlflow.convert")
FORMATS = ("gsm8k", "math")
DATA_SOURCES = {"gsm8k": "openai/gsm8k", "math": "math"}
HUB = {"gsm8k": ("openai/gsm8k", "main/*.parquet"),  # the Hub dataset of each format, and its files
       "math": ("DigitalLearningGmbH/MATH-lighteval", "data/*.parquet")}
SPLITS = ("train", "test")
INSTRUCTIONS = {"gsm8k": ' Let\'s think step by step and output the final answer after "####".',
                "math": " Let's think step by step and put the final answer in \\boxed{}."}
_GSM8K_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class _Skip(Exception):
    """An unusable source row; the message is the reason, counted under ``skipped/<reason>``."""


def _text(row: dict, field: str) -> str:
    value = row.get(field)
    if value is None:
        raise _Skip(f"missing_{field}")
    if not isinstance(value, str):
        raise _Skip(f"{field}_type")
    try:
        value.encode("utf-8")  # a str with lone surrogates (JSON escapes) cannot be written
    except UnicodeError:
        raise _Skip("bad_text") from None
    if not value.strip():
        raise _Skip(f"empty_{field}")
    return value


def _gsm8k(row: dict) -> tuple[str, str, dict]:
    """(question, ground truth, extra text fields) of one GSM8K row."""
    question, answer = _text(row, "question"), _text(row, "answer")
    marker = answer.rfind("####")
    if marker < 0:
        raise _Skip("no_answer_marker")
    truth = answer[marker + 4:].strip().replace(",", "")
    if not _GSM8K_NUMBER.fullmatch(truth):
        raise _Skip("answer_not_number")
    return question, truth, {"question": question, "answer": answer}


def _math(row: dict) -> tuple[str, str, dict]:
    """(problem, ground truth, extra text fields) of one MATH row."""
    info = {"problem": _text(row, "problem")}
    for field in ("solution", "answer"):
        if row.get(field) is not None:
            info[field] = _text(row, field)
    if "answer" in info:
        truth: str | None = info["answer"].strip()
    elif "solution" in info:
        truth = last_boxed(info["solution"])
    else:
        raise _Skip("missing_solution")
    if not truth or not truth.strip():
        raise _Skip("no_boxed")
    # Metadata is kept as text so a column stays one type whatever the source used.
    info.update({k: str(row[k]) for k in ("level", "type", "subject") if row.get(k) is not None})
    return info["problem"], truth.strip(), info


_PARSERS: dict[str, Callable[[dict], tuple[str, str, dict]]] = {"gsm8k": _gsm8k, "math": _math}


def _read(path: str) -> list[Any]:
    """The rows of ``path``; a JSON line that does not parse stands as a ``_Skip("bad_json")``."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"source file not found: {path}")
    if file.suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"{path}: unsupported source file type; use .jsonl, .json or .parquet")
    try:
        if file.suffix == ".parquet":
            return pq.read_table(path).to_pylist()
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeError, pa.ArrowException) as e:
        raise ValueError(f"could not read {path}: {e!r}") from e
    if file.suffix == ".json":
        try:
            whole = json.loads(text)
            return whole if isinstance(whole, list) else [whole]
        except json.JSONDecodeError:
            pass  # JSON lines under a .json name, as datasets also accepts
    return [_parse_line(line) for line in text.splitlines() if line.strip()]


def _parse_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return _Skip("bad_json")


def _write(rows: list[dict], dst: str) -> None:
    """Write ``rows`` to ``dst`` (.parquet or .jsonl) through a temporary file and ``os.replace``."""
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # same directory, so os.replace is atomic
    try:
        if out.suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(rows), str(tmp))
        else:
            with tmp.open("w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fetch(fmt: str, out_dir: str, data_source: str | None = None,
          instruction: str | None = None) -> dict[str, dict[str, int]]:
    """The Hub dataset of format ``fmt``, fetched into the HF cache (raises ``hub.HubError`` where
    it cannot be) and converted to ``out_dir/{train,test}.parquet``; {split: row counts}."""
    repo, pattern = HUB[fmt]
    snapshot = Path(hub.fetch(repo, "dataset", [pattern]))
    shards = {split: sorted(str(p) for p in snapshot.glob(pattern) if p.name.startswith(split)) for split in SPLITS}
    for split, paths in shards.items():
        if not paths:
            raise ValueError(f"{repo}: no {split} split among its files {pattern} (at {snapshot})")
    return {split: convert(paths, str(Path(out_dir) / f"{split}.parquet"), fmt, data_source, instruction, split)
            for split, paths in shards.items()}


def convert(src: str | list[str], dst: str, fmt: str, data_source: str | None = None,
            instruction: str | None = None, split: str = "train") -> dict[str, int]:
    """Convert ``src`` (format ``fmt``; a file, or a split's shards in order) to verl-shaped rows in
    ``dst``; returns row counts.

    Counts are {"rows", "written", "skipped", "skipped/<reason>"...}. Raises ValueError for an
    unknown format or output type, or when no row is usable (naming ``src``), and FileNotFoundError
    for a missing ``src``; ``dst`` is then left untouched.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")
    if Path(dst).suffix not in (".parquet", ".jsonl"):
        raise ValueError(f"{dst}: output must end in .parquet or .jsonl")
    source = DATA_SOURCES[fmt] if data_source is None else data_source
    suffix = INSTRUCTIONS[fmt] if instruction is None else instruction
    counts: Counter[str] = Counter(rows=0, written=0, skipped=0)
    rows = []
    sources = [src] if isinstance(src, str) else src
    for index, row in enumerate(row for path in sources for row in _read(str(path))):
        counts["rows"] += 1
        try:
            if isinstance(row, _Skip):
                raise row
            if not isinstance(row, dict):
                raise _Skip("row_type")
            question, truth, info = _PARSERS[fmt](row)
        except _Skip as skip:
            counts.update(["skipped", f"skipped/{skip}"])
            continue
        rows.append({"data_source": source, "prompt": [{"role": "user", "content": question + suffix}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
                     "extra_info": {"split": split, "index": index, **info}})
    counts["written"] = len(rows)
    if not rows:
        raise ValueError(f"no usable {fmt} rows in {src}: {dict(counts)} (skipped/<reason> names the problem)")
    if counts["skipped"]:
        log.warning("skipped %d of %d rows of %s: %s", counts["skipped"], counts["rows"], src,
                    {k: v for k, v in counts.items() if k.startswith("skipped/")})
    _write(rows, dst)
    return dict(counts)
