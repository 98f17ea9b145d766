"""Run model-written Python in a throwaway subprocess: bounded in time, memory, output and files.

Invariants:
- the parent never hangs: past ``timeout_s`` the child's whole process group is SIGKILLed, and it
  is killed again after a normal exit so no background child outlives the run;
- limits are set by the child on itself before the code runs (soft = hard, so they cannot be
  raised back): address space, CPU seconds, no core files, bytes per written file (stdout and
  stderr included, so runaway output kills the child instead of filling the disk);
- the child starts in a fresh temporary directory, deleted afterwards, with ``-I`` (no user site,
  no PYTHON* variables), stdin at /dev/null and an environment holding only a minimal PATH.

`isolation` adds walls for code the user does not trust (model-written code):
- "namespaces": bubblewrap runs the child in new user, pid, network, ipc and mount namespaces that
  see only the system's and Python's directories (read-only), a private /tmp and the working
  directory; the pid namespace dies with it, whatever the code forked;
- "landlock", where namespaces are refused: the child confines itself with Landlock, reading only
  those directories and writing only its own (engine/data/confine.py);
- under both, a seccomp filter makes socket() fail (no network, no local daemons) and setsid()
  and setpgid() too, so nothing leaves the process group killed at the end;
- "auto" takes the first of those that works here (`resolve_isolation`), and raises
  `SandboxUnavailable` if neither does; "none" (the default for reward functions, whose code is
  the user's) is the limits above alone: that child can still use the network and read whatever
  its user can.

Run its tests with ``python -m pytest tests/engine/data/test_sandbox.py -q``.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from io import BufferedRandom
from pathlib import Path
from typing import NamedTuple

from rlflow.engine.data import confine

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
{confine}
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""
ISOLATIONS = ("auto", "namespaces", "landlock", "none")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32")


class SandboxUnavailable(RuntimeError):
    """No isolation of the kind asked for works on this machine."""


class SandboxResult(NamedTuple):
    returncode: int  # negative: killed by that signal (SIGKILL on timeout)
    stdout: str
    stderr: str
    timed_out: bool


def run_python(code: str, timeout_s: float = 5.0, memory_bytes: int = 1024**3,
               isolation: str = "none") -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh interpreter and working directory; see the module doc."""
    return _run(code, timeout_s, memory_bytes, resolve_isolation(isolation))


def _run(code: str, timeout_s: float, memory_bytes: int, mode: str) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="rlflow-sandbox-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(code)
        boot = _BOOT.format(memory=memory_bytes, cpu=math.ceil(timeout_s) + 1, fsize=MAX_FILE_BYTES,
                            confine=_confinement(mode, work))
        argv = [sys.executable, "-I", "-c", boot]
        if mode == "namespaces":
            argv = _bwrap(work) + argv
        with open(work / ".stdout", "wb+") as out, open(work / ".stderr", "wb+") as err:
            proc = subprocess.Popen(argv, cwd=work, env=ENV,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
            return SandboxResult(proc.returncode, _tail(out), _tail(err), timed_out)


def resolve_isolation(isolation: str) -> str:
    """The isolation `run_python` will use for `isolation`: "auto" becomes the first of
    "namespaces" and "landlock" that runs a child here; raises SandboxUnavailable (saying why each
    failed) when an asked-for isolation does not work."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    if isolation == "none":
        return isolation
    tried = [isolation] if isolation != "auto" else ["namespaces", "landlock"]
    failures = {mode: _probe(mode) for mode in tried}
    working = [mode for mode, failure in failures.items() if not failure]
    if not working:
        why = "; ".join(f"{mode}: {failure}" for mode, failure in failures.items())
        raise SandboxUnavailable(f"cannot isolate model-written code here ({why}). Install bubblewrap "
                                 "(apt-get install bubblewrap) and allow unprivileged user namespaces, "
                                 "or opt out with isolation='none' to run it under resource limits alone")
    return working[0]


@functools.cache
def _probe(mode: str) -> str:
    """Why `mode` cannot run a child here; "" when it can. Run once per process."""
    if mode == "namespaces" and shutil.which("bwrap") is None:
        return "bwrap is not installed"
    if mode == "landlock" and confine.landlock_abi() < 1:
        return "the kernel has no Landlock"
    result = _run("print('ok')", 10.0, 1024**3, mode)
    return "" if result.stdout == "ok\n" else f"a test child failed: {result.stderr.strip()[-300:]}"


def _readable() -> list[str]:
    """What an isolated child reads: the system's directories and this interpreter's."""
    paths = list(SYSTEM_DIRS)
    for path in {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}:
        if not any(path == p or path.startswith(p + "/") for p in paths):
            paths.append(path)
    return paths


def _confinement(mode: str, work: Path) -> str:
    """The lines the child runs on itself after its limits: confine.py's text, then its calls."""
    if mode == "none":
        return ""
    calls = ["block_syscalls()"]
    if mode == "landlock":
        calls.append(f"restrict_files({_readable() + ['/dev/null', '/dev/zero', '/dev/urandom']!r}, "
                     f"{[str(work)]!r})")
    return _confine_source() + "\n" + "\n".join(calls)


@functools.cache
def _confine_source() -> str:
    return Path(confine.__file__).read_text()  # read once, not at every tool call


def _bwrap(work: Path) -> list[str]:
    # the private /tmp first: Python's directories and the working directory may lie under /tmp
    # (a virtualenv there), and a mount made before it would be hidden by it
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--tmpfs", "/tmp", "--proc", "/proc",
            "--dev", "/dev"]
    for path in _readable():
        argv += ["--ro-bind-try", path, path]
    return argv + ["--bind", str(work), str(work), "--chdir", str(work), "--"]


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
