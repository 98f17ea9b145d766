"""Confine the current process without privileges: Landlock for files and TCP, seccomp for
sockets and process groups.

Standard library only: engine/data/sandbox.py runs this file's text inside the child, after its
resource limits and before the model's code, so the child needs nothing of rlflow installed.

Invariants:
- `block_syscalls`: socket() fails with EPERM for every address family, io_uring (which can
  open sockets without that syscall) cannot be set up, and neither setsid() nor setpgid() can
  take a process out of the group its parent kills; a syscall through a foreign ABI (x32, i386
  on x86-64) kills the process rather than slip past the filter;
- `restrict_files`: the process reads and executes files only beneath `readable`, writes only
  beneath `writable`, and, where the kernel's Landlock ABI has them, connects or binds no TCP
  port and reaches no abstract unix socket or process outside its domain;
- both set no_new_privs first, are inherited by every child, and cannot be lifted.

Run its tests with ``python -m pytest tests/engine/data/test_sandbox.py -q``.
"""

import ctypes
import os
import platform
import struct

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
# per architecture: the audit arch tag seccomp sees, and the numbers of the syscalls refused:
# socket, io_uring_setup (its rings can open sockets), setsid and setpgid (ways out of the process
# group the parent kills)
_ARCH = {"x86_64": (0xC000003E, (41, 425, 112, 109)), "aarch64": (0xC00000B7, (198, 425, 157, 154))}


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _no_new_privs() -> None:
    _check(_LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is absent or disabled."""
    return max(0, _LIBC.syscall(_CREATE_RULESET, None, 0, 1))  # flag 1: report the version


class _Filter(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def block_syscalls() -> None:
    """socket(), io_uring_setup(), setsid() and setpgid() fail with EPERM from here on."""
    if platform.machine() not in _ARCH:
        raise OSError(f"no syscall filter for {platform.machine()}")
    audit, refused = _ARCH[platform.machine()]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    n = len(refused)
    prog = [(ld, 0, 0, 4), (jeq, 0, n + 4, audit),  # the arch field: a foreign ABI jumps to kill
            (ld, 0, 0, 0), (jge, n + 2, 0, 0x40000000)]  # the syscall number: x32's carry bit 30
    prog += [(jeq, n - i, 0, nr) for i, nr in enumerate(refused)]  # a match jumps to EPERM
    prog += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | 1), (ret, 0, 0, 0x80000000)]  # allow, EPERM, kill
    code = b"".join(struct.pack("=HBBI", *op) for op in prog)
    _no_new_privs()
    fprog = _Filter(len(prog), code)
    _check(_LIBC.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def restrict_files(readable: list[str], writable: list[str]) -> None:
    abi = landlock_abi()
    if abi < 1:
        raise OSError("Landlock is not available in this kernel")
    read = 1 | 4 | 8  # EXECUTE, READ_FILE, READ_DIR
    fs = (1 << 13) - 1 | (abi >= 2) << 13 | (abi >= 3) << 14 | (abi >= 5) << 15  # every right the ABI knows
    net = 3 if abi >= 4 else 0  # BIND_TCP, CONNECT_TCP: handled with no rule, so denied
    scoped = 3 if abi >= 6 else 0  # abstract unix sockets, signals
    attr = struct.pack("=QQQ", fs, net, scoped)[:8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _check(_LIBC.syscall(_CREATE_RULESET, attr, len(attr), 0), "landlock_create_ruleset")
    for paths, access in ((readable, read), (writable, fs)):
        for path in paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            allowed = access if os.path.isdir(path) else access & (1 | 2 | 4 | (abi >= 3) << 14)  # a file's
            rule = struct.pack("=Qi", allowed, fd)  # rule holds file rights only: EXECUTE, WRITE, READ, TRUNCATE
            _check(_LIBC.syscall(_ADD_RULE, ruleset, 1, rule, 0), f"landlock_add_rule({path})")
            os.close(fd)
    _no_new_privs()
    _check(_LIBC.syscall(_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)
