"""engine/data/sandbox.py: real subprocesses under time, memory, output and environment limits, and
isolated from the network and the user's files."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from rlflow.engine.data.sandbox import MAX_OUTPUT_BYTES, SandboxUnavailable, _probe, resolve_isolation, run_python


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


def isolation_here(mode: str) -> str:
    """`mode` if it works on this machine; skips without it, except under RLFLOW_REQUIRE_ISOLATION
    (.ci/run sets it, and installs bubblewrap): there "auto" must find an isolation and bubblewrap
    must be installed; only what the kernel refuses (user namespaces, Landlock) may skip."""
    try:
        return resolve_isolation(mode)
    except SandboxUnavailable as e:
        required = os.environ.get("RLFLOW_REQUIRE_ISOLATION")
        if required and (mode == "auto" or (mode == "namespaces" and "not installed" in str(e))):
            raise
        pytest.skip(str(e))


PROBE = """
import os, socket
for family in (socket.AF_INET, socket.AF_UNIX):
    try:
        socket.socket(family)
        print("socket opened")
    except OSError as e:
        print("no socket:", e.errno)
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("CONNECTED")
except OSError as e:
    print("no connection:", e.errno)
for path in ({secret!r}, {home!r}):
    try:
        print(open(path).read() if os.path.isfile(path) else os.listdir(path))
    except OSError as e:
        print("unreadable:", e.errno)
open("own.txt", "w").write("mine")
print(open("own.txt").read())
"""


@pytest.mark.parametrize("mode", ["auto", "namespaces", "landlock"])
def test_isolated_code_reaches_no_socket_and_not_the_users_home(mode, tmp_path) -> None:
    """A listening port on loopback and a file in the user's home, both in reach of plain code
    (checked first): isolated code opens no socket, connects nowhere and reads neither."""
    mode = isolation_here(mode)
    with socket.create_server(("127.0.0.1", 0)) as server, \
            tempfile.NamedTemporaryFile("w", dir=Path.home(), prefix=".rlflow-secret-") as secret:
        secret.write("hunter2")
        secret.flush()
        code = PROBE.format(port=server.getsockname()[1], secret=secret.name, home=str(Path.home()))
        plain = run_python(code).stdout
        assert "CONNECTED" in plain and "hunter2" in plain
        isolated = run_python(code, isolation=mode)
    assert isolated.returncode == 0, isolated.stderr
    lines = isolated.stdout.splitlines()
    assert lines[:3] == ["no socket: 1", "no socket: 1", "no connection: 1"]  # EPERM, from the filter
    assert "hunter2" not in isolated.stdout and "secret" not in isolated.stdout
    assert lines[-1] == "mine"


@pytest.mark.parametrize("mode", ["namespaces", "landlock"])
def test_isolated_code_cannot_leave_the_group_that_is_killed(mode) -> None:
    mode = isolation_here(mode)
    marker = f"{61 + len(mode)}.{os.getpid()}"
    code = ("import os, subprocess, time\ntry:\n    os.setsid()\nexcept OSError as e:\n    print(e.errno, flush=True)\n"
            f"subprocess.Popen(['sleep', '{marker}'])\ntime.sleep(60)")
    result = run_python(code, timeout_s=1, isolation=mode)
    assert result.timed_out and result.stdout == "1\n"
    deadline = time.monotonic() + 2.0
    while _sleeping(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _sleeping(marker)


def _sleeping(marker: str) -> bool:
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes() and _running(int(proc.name)):
                return True
        except OSError:
            continue
    return False


def test_isolation_that_cannot_work_is_refused_with_the_way_out(monkeypatch) -> None:
    with pytest.raises(ValueError, match="isolation must be one of"):
        run_python("pass", isolation="docker")
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to find
    _probe.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="bwrap is not installed.*isolation='none'"):
            resolve_isolation("namespaces")
    finally:
        _probe.cache_clear()
