"""engine/data/sandbox.py: real subprocesses under time, memory, output and environment limits."""

from __future__ import annotations

import os
import time
from pathlib import Path

from engine.data.sandbox import MAX_OUTPUT_BYTES, run_python


def test_exit_status_and_output_come_back() -> None:
    result = run_python("import sys\nprint('hi')\nprint('oops', file=sys.stderr)\nsys.exit(3)")
    assert (result.returncode, result.stdout, result.stderr, result.timed_out) == (3, "hi\n", "oops\n", False)


def test_a_timeout_kills_the_whole_process_group() -> None:
    code = "import subprocess, time\nprint(subprocess.Popen(['sleep', '60']).pid, flush=True)\ntime.sleep(60)"
    start = time.perf_counter()
    result = run_python(code, timeout_s=1)
    assert time.perf_counter() - start < 3.0
    assert result.timed_out and result.returncode < 0
    grandchild = int(result.stdout)
    deadline = time.monotonic() + 2.0  # SIGKILL lands asynchronously
    while _running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _running(grandchild)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def test_memory_and_file_size_limits() -> None:
    assert "MemoryError" in run_python("x = bytearray(4 * 1024**3)").stderr
    result = run_python("while True:\n    print('x' * 100_000)")  # stopped by RLIMIT_FSIZE, not the timeout
    assert result.returncode != 0 and not result.timed_out
    assert len(result.stdout) <= MAX_OUTPUT_BYTES and "File too large" in result.stderr


def test_environment_is_stripped_and_the_working_directory_is_fresh_and_removed(monkeypatch) -> None:
    monkeypatch.setenv("RLFLOW_SECRET", "hunter2")
    code = "import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.environ))"
    result = run_python(code)
    cwd, env = result.stdout.splitlines()
    assert result.returncode == 0 and cwd != os.getcwd()
    assert "RLFLOW_SECRET" not in env and "HOME" not in env
    assert not Path(cwd).exists()


def test_stdin_is_empty() -> None:
    assert run_python("import sys\nassert sys.stdin.read() == ''").returncode == 0
