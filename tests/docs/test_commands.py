"""The docs' commands work as written.

README.md and each how-to (docs/howto/*.md) are run: every fenced `bash` block of a page, in order,
in a fresh directory of the page's own, unless the block's first line marks it:
- `# needs a GPU`: its rlflow commands only have to resolve, for one GPU, to a valid config;
- `# run by tests/PATH.py`: that test module runs the block's programs (checked by name).
The README's install and test commands are what .ci/run runs. A code block whose first line is
`# FILE` is written to the page's directory as FILE first (a json or jsonl block without that line).
`rlflow train|sft|dpo|eval` commands run CPU-sized: settings for one short step are appended where
a command sets none of its own. Reads from the Hugging Face Hub run offline, against a cache that
holds a few rows of openai/gsm8k. The other pages' rlflow commands must resolve to a valid config,
and every relative link of every page must reach a file and heading that exist.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
from conftest import plant

from rlflow.pipelines.cli import parse

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RUN = [ROOT / "README.md", *sorted((ROOT / "docs" / "howto").glob("*.md"))]
RECORDS = ("benchmarks.md", "logs")  # what was run, as it was run: not commands to resolve today
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if not set(p.parts) & set(RECORDS))]
GPU, RUN_BY = "# needs a GPU", "# run by "
CPU_SIZED = {"trainer.total_steps": "1", "warmstart.steps": "2",
             "data.prompts_per_step": "8", "actor.mini_batch_prompts": "8", "data.val_max_prompts": "8",
             "trainer.val_samples": "2", "trainer.val_every": "0"}
EVAL_SIZED = {"data.val_max_prompts": "8", "rollout.samples_per_prompt": "2"}
INSTALL = ("python3 -m venv", ". .venv/bin/activate", "pip install", "python -m pytest")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    lines: list[str] = field(default_factory=list)

    @property
    def marker(self) -> str:
        return self.lines[0].strip() if self.lines and self.lines[0].startswith("# ") else ""

    def commands(self) -> list[str]:
        """Its command lines: continuations joined, comments dropped, `a && b` split."""
        out, joined = [], ""
        for line in self.lines:
            line = line.split(" #")[0] if not line.lstrip().startswith("#") else ""
            joined += line.rstrip()
            if joined.endswith("\\"):
                joined = joined[:-1] + " "
                continue
            out += [c.strip() for c in joined.split("&&") if c.strip()]
            joined = ""
        return out


def blocks(page: Path) -> list[Block]:
    found, current = [], None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            if current is None:
                current = Block(page, number, line.strip()[3:].strip())
            else:
                found.append(current)
                current = None
        elif current is not None:
            current.lines.append(line)
    return found


def test_the_readme_is_a_users_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def _install(text: str) -> str:
    """An install or test command as .ci/run and the README may both write it: quiet flags, quotes
    and extras apart."""
    return " ".join(re.sub(r"\[\w,]+\]|['\"]| -q\b", "", text).split())


def unrun(command: str, test: str) -> list[str]:
    """What of `command` the test's source never names: its program and verb and a recipe it names
    (each a quoted string of its own), and each setting's key (`key=`: the test gives its own value,
    CPU-sized); the command's own paths are the test's to choose."""
    from rlflow.engine.recipes import shipped

    words = [w for w in shlex.split(command) if "=" in w and not w.startswith("-") or w in shipped()]
    named = [w for w in [*shlex.split(command)[:2], *words] if "=" not in w]
    keys = [w.split("=")[0] + "=" for w in words if "=" in w]
    return [w for w in named if f'"{w}"' not in test] + [k for k in keys if k not in test]


def test_every_command_is_run_or_marked():
    """A how-to's or the README's bash block is run here, or marked as needing a GPU, or names the
    test module that runs its programs; the install and test commands are .ci/run's."""
    ci = _install((ROOT / ".ci" / "run").read_text())
    for page in RUN:
        for block in (b for b in blocks(page) if b.lang == "bash"):
            where = f"{page.relative_to(ROOT)}:{block.line}"
            assert block.marker in (GPU, "") or block.marker.startswith(RUN_BY), f"{where}: {block.marker!r}"
            if block.marker.startswith(RUN_BY):
                test = ROOT / block.marker[len(RUN_BY):]
                assert test.is_file(), f"{where}: no {test}"
                for command in block.commands():
                    missing = unrun(command, test.read_text())
                    assert not missing, f"{where}: {test.name} never runs {missing}"
            for command in (c for c in block.commands() if c.startswith(INSTALL)):
                assert _install(command) in ci, f"{where}: .ci/run does not run `{command}`"


def test_the_docs_show_commands_to_check():
    assert sum(len(b.commands()) for p in RUN for b in blocks(p) if b.lang == "bash" and not b.marker) >= 15
    assert sum(1 for p in RUN for b in blocks(p) if b.marker == GPU) >= 10


def rlflow_commands(page: Path, marker: str | None = None) -> list[tuple[str, str]]:
    out = []
    for block in blocks(page):
        if block.lang != "bash" or (marker is not None and block.marker != marker):
            continue
        for command in block.commands():
            if re.search(r"(^|\s)rlflow (train|sft|dpo|eval)\b", command):
                out.append((f"{page.relative_to(ROOT)}:{block.line}", command[command.index("rlflow "):]))
    return out


RESOLVED = [c for p in PAGES for c in rlflow_commands(p, GPU if p in RUN else None) if "$" not in c[1]]


@pytest.mark.parametrize("command", [c for _, c in RESOLVED], ids=[w for w, _ in RESOLVED])
def test_a_command_for_a_gpu_or_another_page_resolves_to_a_valid_config(command):
    verb, *args = shlex.split(command)[1:]
    if verb == "eval":
        args = args[1:]  # the model
    parse(args, verb if verb in ("dpo", "sft") else None, gpus=1)


GSM8K = [{"question": f"Tom has {a} apples and buys {b} more. How many does he have?",
          "answer": f"{a}+{b}={a + b}\n#### {a + b}"} for a in range(2, 12) for b in (3, 4)]


@pytest.fixture(scope="module")
def hub_with_gsm8k(tmp_path_factory) -> Path:
    """A Hugging Face cache holding openai/gsm8k's files, as `rlflow data gsm8k` reads them."""
    root = tmp_path_factory.mktemp("hf")
    (root / "files" / "main").mkdir(parents=True)
    pd.DataFrame(GSM8K[:16]).to_parquet(root / "files" / "main" / "train-00000-of-00001.parquet")
    pd.DataFrame(GSM8K[16:]).to_parquet(root / "files" / "main" / "test-00000-of-00001.parquet")
    plant(root / "hub", "openai/gsm8k", root / "files", kind="dataset")
    return root / "hub"


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An empty MLflow store with its tables made: a run's first write would take about 5 s to make them."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def sized(command: str) -> list[str]:
    """The command's words, CPU-sized where it leaves a setting to its recipe."""
    words = shlex.split(command)
    extra = CPU_SIZED if words[1] in ("train", "sft", "dpo") else EVAL_SIZED if words[1] == "eval" else {}
    given = {w.split("=")[0] for w in words if "=" in w}
    return [str(BIN / words[0]), *words[1:], *(f"{k}={v}" for k, v in extra.items() if k not in given)]


def serve(command: str, cwd: Path, env: dict[str, str]) -> None:
    """A command that starts a server (`mlflow ui`): it must answer on its port, then it is stopped."""
    words = shlex.split(command)
    port = words[words.index("--port") + 1] if "--port" in words else "5000"
    proc = subprocess.Popen([str(BIN / words[0]), *words[1:]], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 90
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as answer:
                    assert answer.status == 200
                    return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"`{command}` never answered on port {port}: {proc.stderr.read()[-2000:]!r}")
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_runs_as_written(page, tmp_path, hub_with_gsm8k, empty_store):
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(hub_with_gsm8k), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    shutil.copy(empty_store, tmp_path / "mlflow.db")  # the default store, ./mlflow.db, its tables made
    ran = 0
    for block in blocks(page):
        if block.lines and re.fullmatch(r"# [\w./-]+\.\w+", block.lines[0].strip()) and block.lang != "bash":
            body = block.lines[1:] if block.lang in ("json", "jsonl") else block.lines
            (tmp_path / block.lines[0][2:].strip()).write_text("\n".join(body) + "\n")
        if block.lang != "bash" or block.marker:
            continue
        for command in block.commands():
            if command.startswith(INSTALL):
                continue  # .ci/run installs and tests (test_every_command_is_run_or_marked)
            if command.startswith("mlflow ui"):
                serve(command, tmp_path, env)
            else:
                proc = subprocess.run(sized(command), cwd=tmp_path, env=env, capture_output=True, text=True,
                                      timeout=600)
                assert proc.returncode == 0, f"{page.name}: `{command}`\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
            ran += 1
    if not ran:
        pytest.skip(f"{page.name} has no command to run on the CPU")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_reaches_a_file_and_heading():
    broken = []
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
