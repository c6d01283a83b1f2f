"""Faults and foreign environments the tests inject: a real filesystem that fills up (tmpfs, mounted for a
block), temp-file writes or fsyncs that fail like a full disk or an exhausted quota (inject_disk_full), a
command run as on a second host with its own hostname and /dev/shm (as_other_host, other_host_unavailable), and
the folder whose sitecustomize shifts a process's clock (CLOCK_SKEW_DIR).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import subprocess
from pathlib import Path

from .processes import REPO

# Its sitecustomize shifts time.time() by $ASYNCGRPO_TEST_CLOCK_OFFSET_S.
CLOCK_SKEW_DIR = REPO / "tests" / "processes" / "clock_skew"
_OTHER_HOST_SHELL = 'hostname "$0" && mount -t tmpfs tmpfs /dev/shm && exec "$@"'


def as_other_host(argv: list[str], hostname: str = "otherhost") -> list[str]:
    """``argv`` run as on a second host: its own hostname (a UTS namespace) and its own, empty
    /dev/shm (a mount namespace); the same kernel, pids and run directory. Needs root."""
    return ["unshare", "-u", "-m", "--propagation", "private", "sh", "-c", _OTHER_HOST_SHELL, hostname, *argv]


def other_host_unavailable() -> str | None:
    """Why ``as_other_host`` cannot work here (for pytest.skip), or None when it can."""
    try:
        result = subprocess.run(as_other_host(["true"]), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unshare cannot run: {err}"
    if result.returncode != 0:
        return f"unshare -u -m cannot make a second host here: {result.stderr.strip()[:200]}"
    return None


# ---------------------------------------------------------------------- a full disk


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_MNT_DETACH = 2


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A real filesystem of ``size`` (e.g. "64k") mounted at ``path`` for the block: a disk that fills up. Skips
    the test where mounting is not allowed (it needs root / CAP_SYS_ADMIN)."""
    import pytest

    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 0, f"size={size}".encode()) != 0:
        code = ctypes.get_errno()
        if code in (errno.EPERM, errno.EACCES):
            pytest.skip(f"cannot mount a tmpfs here: {os.strerror(code)} (needs root / CAP_SYS_ADMIN)")
        raise OSError(code, f"mount tmpfs at {path}: {os.strerror(code)}")
    try:
        yield Path(path)
    finally:
        if _libc.umount2(os.fsencode(path), 0) != 0:
            _libc.umount2(os.fsencode(path), _MNT_DETACH)


def _fd_in(fd, directory) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory) + os.sep)
    except OSError:
        return False


def inject_disk_full(m, run, where):
    """Makes writes of temp files in ``run.tmp`` fail like a full disk (other fds untouched).

    write:  a short write of half the first chunk, then ENOSPC (what a filling disk does)
    quota:  the same with EDQUOT
    fsync:  all data written, then fsync fails with ENOSPC (delayed allocation, NFS)
    """
    real_write, real_fsync = os.write, os.fsync
    code = errno.EDQUOT if where == "quota" else errno.ENOSPC
    state = {"writes": 0, "failed": 0}

    def write(fd, data):
        if where in ("write", "quota") and _fd_in(fd, run.tmp):
            state["writes"] += 1
            if state["writes"] == 1 and len(data) > 1:
                return real_write(fd, memoryview(data)[: len(data) // 2])
            state["failed"] += 1
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    def fsync(fd):
        if where == "fsync" and _fd_in(fd, run.tmp):
            state["failed"] += 1
            raise OSError(code, os.strerror(code))
        return real_fsync(fd)

    from asyncgrpo.run import fileops

    m.setattr(fileops.os, "write", write)
    m.setattr(fileops.os, "fsync", fsync)
    return state
