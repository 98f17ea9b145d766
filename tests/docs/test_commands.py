"""Every `rlflow train|dpo|sft` command the README and docs show resolves to a valid config.

A shipped config that gains a setting can make a documented command fail validation (a config
that packs sequences against a command that asks for sequence parallelism, say); this catches it
without running anything. Commands with shell variables are skipped, and paths are not checked:
the docs point at the reader's own model and data."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rlflow.pipelines.cli import parse

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def documented_commands() -> list[tuple[str, str, Path]]:
    """(page:line, command, where it runs) for each rlflow train/dpo/sft line in a fenced block,
    continuations joined; it runs in the repository root unless the line `cd`s first."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        fenced, i = False, 0
        while i < len(lines):
            line, start = lines[i], i
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced and re.search(r"(^|\s)rlflow (train|dpo|sft)\b", line):
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                command = line[line.index("rlflow "):].split(" #")[0].split(";")[0].strip()
                cd = re.search(r"\bcd (\S+) &&", line[:line.index("rlflow ")])
                found.append((f"{page.relative_to(ROOT)}:{start + 1}", command, ROOT / cd[1] if cd else ROOT))
            i += 1
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands_to_check():
    assert len(COMMANDS) >= 20, [c for _, c, _ in COMMANDS]


@pytest.mark.parametrize("command,cwd", [(c, d) for _, c, d in COMMANDS if "$" not in c],
                         ids=[w for w, c, _ in COMMANDS if "$" not in c])
def test_a_documented_command_resolves_to_a_valid_config(command, cwd):
    verb, *args = shlex.split(command)[1:]
    if args and args[0].endswith(".yaml"):
        args[0] = str((cwd / args[0]).resolve())
    parse(args, verb if verb in ("dpo", "sft") else "rl")
