"""Run model-written Python in a throwaway subprocess: bounded in time, memory, output and files.

Invariants:
- the parent never hangs: past ``timeout_s`` the child's whole process group is SIGKILLed, and it
  is killed again after a normal exit so no background child outlives the run;
- limits are set by the child on itself before the code runs (soft = hard, so they cannot be
  raised back): address space, CPU seconds, no core files, bytes per written file (stdout and
  stderr included, so runaway output kills the child instead of filling the disk);
- the child starts in a fresh temporary directory, deleted afterwards, with ``-I`` (no user site,
  no PYTHON* variables), stdin at /dev/null and an environment holding only a minimal PATH.

This guards against buggy or runaway code, not a determined attacker: the child can still use the
network, read files its user can read, or call setsid() to leave the process group. Use a
container for hostile code.

Run its tests with ``python -m pytest tests/engine/data/test_sandbox.py -q``.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
from io import BufferedRandom
from pathlib import Path
from typing import NamedTuple

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
MAX_FILE_BYTES = 16 * 1024**2
MAX_OUTPUT_BYTES = 64 * 1024  # kept from the end of stdout and stderr: tracebacks are at the end

# Set by the child on itself rather than through preexec_fn, which can deadlock a threaded parent
# (a Ray actor always is). CPU seconds track the wall timeout with a second of slack.
_BOOT = """\
import resource, runpy, sys
for name, limit in ((resource.RLIMIT_AS, {memory}), (resource.RLIMIT_CPU, {cpu}),
                    (resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, {fsize})):
    resource.setrlimit(name, (limit, limit))
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


class SandboxResult(NamedTuple):
    returncode: int  # negative: killed by that signal (SIGKILL on timeout)
    stdout: str
    stderr: str
    timed_out: bool


def run_python(code: str, timeout_s: float = 5.0, memory_bytes: int = 1024**3) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh interpreter and working directory; see the module doc."""
    boot = _BOOT.format(memory=memory_bytes, cpu=math.ceil(timeout_s) + 1, fsize=MAX_FILE_BYTES)
    with tempfile.TemporaryDirectory(prefix="rlflow-sandbox-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(code)
        with open(work / ".stdout", "wb+") as out, open(work / ".stderr", "wb+") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-c", boot], cwd=work, env=ENV,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
            return SandboxResult(proc.returncode, _tail(out), _tail(err), timed_out)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader while any member lives
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(file: BufferedRandom) -> str:
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - MAX_OUTPUT_BYTES))
    return file.read().decode("utf-8", errors="replace")
