"""Every rename, link, fsync and directory scan of the run directory happens here.

Why each operation looks the way it does:

* A write goes to a temp file in ``queue/.tmp/``, is fsynced, then *linked* to its final
  name (``link`` fails with EEXIST, so it never overwrites) and the temp name unlinked.
  A reader never sees a partial file under a final name.
* A transition inside one directory is ``renameat2(RENAME_NOREPLACE)``: atomic, exactly
  one claimant wins, and an existing target is reported, never replaced. Where the
  filesystem lacks it we fall back to ``link`` + ``unlink``, whose loser is whoever fails
  the unlink; the loser removes its own link.
* A move into another directory (queue/ -> done/) is ``link`` + ``unlink`` as well: a
  cross-directory rename shows up in the watched ``queue/`` as an unpaired
  IN_MOVED_FROM, which watchdog holds for 0.5 s while every later event waits behind it.
* Payloads are loaded with ``torch.load(weights_only=True)`` from a descriptor opened with
  O_NOFOLLOW and checked to be a regular file: a file cannot run code or redirect us.

torch is imported lazily so that ``queue_tools ls`` answers without loading it.
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import stat
import uuid
from collections.abc import Iterator

from asyncgrpo.messages import first_line
from asyncgrpo.run.hosts import HOST_ID  # temp names say who writes them

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
_WRITE_CHUNK = 1 << 20


class QueueWriteError(OSError):
    """A payload could not be written (disk full, permissions, ...). Nothing was published."""


class PayloadLoadError(ValueError):
    """A queue file is not a loadable, plain-data payload."""


# What a run writes is its owner's alone unless the run is shared with its group (--share_with_group, for
# workers run by other users of a cluster): a lock file others can open is a lock they can take, and block
# the PS with. The umask applies the choice to every file and folder the process creates, those of torch,
# transformers and TensorBoard included; files are opened with 0o666 and folders made with 0o777 under it.
OWNER_ONLY_UMASK = 0o077
GROUP_SHARED_UMASK = 0o007


def set_file_modes(share_with_group: bool) -> int:
    """Files and folders this process creates from now on: owner-only, or also the group's. Returns the umask
    it replaces."""
    return os.umask(GROUP_SHARED_UMASK if share_with_group else OWNER_ONLY_UMASK)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scan(directory: str | os.PathLike) -> list[os.DirEntry]:
    """The entries of one directory (no recursion, no stat calls beyond what scandir caches)."""
    with os.scandir(directory) as it:
        return list(it)


def scan_one_by_one(directory: str | os.PathLike) -> Iterator[os.DirEntry]:
    """The entries of one directory, one at a time: the memory a pass over done/ takes stays flat however many
    names the run has archived (they are never deleted: they are the ledger)."""
    with os.scandir(directory) as it:
        yield from it


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data[:_WRITE_CHUNK])
        data = data[written:]


def stage_bytes(tmp_dir: str | os.PathLike, data: bytes | memoryview, *, fsync: bool = True) -> str:
    """Writes ``data`` to a new temp file in ``tmp_dir`` and returns its path.

    On any failure the temp file is removed and QueueWriteError names the problem.
    """
    path = os.path.join(tmp_dir, f"{HOST_ID}-{os.getpid()}-{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as err:
        raise QueueWriteError(err.errno, f"cannot create a temp file in {tmp_dir}: {err.strerror}") from err
    try:
        _write_all(fd, memoryview(data))
        if fsync:
            os.fsync(fd)
    except OSError as err:
        os.close(fd)
        _unlink_quietly(path)
        message = f"cannot write {len(data)} bytes to {tmp_dir}{_full(err)}: {err.strerror}"
        raise QueueWriteError(err.errno, message) from err
    os.close(fd)
    return path


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or the user's quota on it


def _full(err: OSError) -> str:
    return " (disk full)" if err.errno in DISK_FULL else ""


def serialize(payload: dict) -> memoryview:
    import torch

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getbuffer()


def publish(tmp_path: str, final_path: str | os.PathLike, *, fsync: bool = True) -> None:
    """Gives a staged temp file its final name without ever overwriting.

    Raises FileExistsError if the final name exists, QueueWriteError if the link fails otherwise (a full
    disk: a directory may need a new block); the temp file is then left in place for the caller to
    archive or drop.
    """
    try:
        os.link(tmp_path, final_path)
    except FileExistsError:
        raise
    except OSError as err:
        raise QueueWriteError(err.errno, f"cannot link {final_path}{_full(err)}: {err.strerror}") from err
    os.unlink(tmp_path)
    if fsync:
        fsync_dir(os.path.dirname(os.fspath(final_path)))


def write_payload(tmp_dir: str | os.PathLike, final_path: str | os.PathLike, payload: dict, *,
                  fsync: bool = True) -> None:
    """Atomic, durable, no-clobber write of one payload (raises FileExistsError, QueueWriteError)."""
    tmp_path = stage_bytes(tmp_dir, serialize(payload), fsync=fsync)
    try:
        publish(tmp_path, final_path, fsync=fsync)
    except OSError:
        _unlink_quietly(tmp_path)
        raise


def move(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Renames ``src`` to ``dst`` unless ``dst`` exists (FileExistsError) or ``src`` is gone
    (FileNotFoundError: someone else moved it first)."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))
    _link_then_unlink(src, dst)


def move_to_other_dir(src: str | os.PathLike, dst: str | os.PathLike, *, fsync: bool = True) -> None:
    """No-clobber move into another directory that emits no IN_MOVED_FROM in the source's."""
    if stat.S_ISDIR(os.lstat(src).st_mode):  # only a hostile file is a directory; links can't take it
        move(src, dst)
    else:
        _link_then_unlink(src, dst)
    if fsync:
        fsync_dir(os.path.dirname(os.fspath(dst)))


def _link_then_unlink(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    os.link(src, dst, follow_symlinks=False)
    try:
        os.unlink(src)
    except FileNotFoundError:
        # Another process moved src between our link and unlink: it won, we undo.
        os.unlink(dst)
        raise


def unlink_second_name(path: str | os.PathLike) -> None:
    """Removes ``path``, one of two names of a file a move was cut short between (link done,
    unlink not): the file itself stays under its other name."""
    if os.lstat(path).st_nlink < 2:
        raise FileExistsError(f"{os.fspath(path)} is the file's only name")
    os.unlink(path)
    fsync_dir(os.path.dirname(os.fspath(path)))


def _load_failure(err: Exception) -> str:
    """What torch.load found wrong, without its advice: of a file its safe loader refuses, torch's first line says to
    load it again with weights_only=False, which runs whatever code the file holds."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n", 1)[0].strip()
        return f"torch's safe loader refused it ({detail})" if detail else "torch's safe loader refused it"
    return (first_line(err, with_type=False) or type(err).__name__)[:200]


def load_payload(path: str | os.PathLike, max_bytes: int | None = None) -> dict:
    """Loads a plain-data payload; refuses symlinks, non-regular files, pickled code and, before reading it, a file
    larger than ``max_bytes``."""
    import torch

    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise PayloadLoadError(f"{os.fspath(path)} is a symlink") from err
        raise
    try:  # (checked on the descriptor: Python's file object of a directory's is an error naming the descriptor)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PayloadLoadError(f"{os.fspath(path)} is " + (
                "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"))
        if max_bytes is not None and st.st_size > max_bytes:
            raise PayloadLoadError(f"{os.fspath(path)} is {st.st_size / 1e6:,.1f} MB, over the "
                                   f"{max_bytes / 1e6:,.1f} MB cap on a job or result file (--max_payload_mb)")
        if st.st_size == 0:
            raise PayloadLoadError(f"{os.fspath(path)} is empty")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:  # (it owns the descriptor from here: closed by it, however it fails)
        data = f.read()
    try:
        payload = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as err:  # torch raises several types for truncated/hostile input
        raise PayloadLoadError(f"{os.fspath(path)} is not a plain-data torch payload: {_load_failure(err)}") from err
    if not isinstance(payload, dict):
        raise PayloadLoadError(f"{os.fspath(path)} holds a {type(payload).__name__}, not a dict")
    return payload


def replace_file(path: str | os.PathLike, data: bytes, *, fsync: bool = False) -> None:
    """Atomically replaces a small status file (heartbeats, versions, progress).

    The temp name starts with a dot in the same directory, so scanners skip it.
    """
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _write_all(fd, memoryview(data))
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # status files are meant to be replaced
    except OSError as err:  # a full disk fails the write as often as the rename: no temp file left either way
        _unlink_quietly(tmp)
        raise OSError(err.errno, err.strerror, path) from err  # the error names the file (the write's did not)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def append_line(path: str | os.PathLike, line: str) -> None:
    """Appends one line in one write (a reader never sees half of two lines); an error names the file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            _write_all(fd, memoryview(f"{line}\n".encode()))
        finally:
            os.close(fd)
    except OSError as err:
        raise OSError(err.errno, err.strerror, os.fspath(path)) from err


def write_json(path: str | os.PathLike, obj: object, *, fsync: bool = False) -> None:
    replace_file(path, json.dumps(obj, sort_keys=True).encode(), fsync=fsync)


JSON_MAX_BYTES = 256 << 20  # the producer's journal holds whole generation batches of prompts


def read_json(path: str | os.PathLike) -> dict | None:
    """A JSON status file (or the producer's journal), or None when it is missing, unreadable or larger than
    JSON_MAX_BYTES."""
    try:
        with open(path, "rb") as f:
            obj = None if os.fstat(f.fileno()).st_size > JSON_MAX_BYTES else json.loads(f.read())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def touch(path: str | os.PathLike) -> float:
    """Creates or touches ``path``; returns its new mtime (the filesystem's clock)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        os.utime(fd)
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)


def stamp_now(path: str | os.PathLike) -> float:
    """Sets ``path``'s mtime to now by the file server's clock and returns it.

    ``utime(path, None)`` asks the filesystem for "now" (on NFS the server sets its own
    time); a time passed in would be this host's clock, which may be off by seconds. Every
    mtime recovery compares (claims, fences, heartbeats) is set this way, so all of them are
    on one clock: the one ``liveness.fs_now`` reads.
    """
    os.utime(path, None, follow_symlinks=False)
    return os.lstat(path).st_mtime


def truncate_archived(path: str | os.PathLike, expected: os.stat_result) -> int:
    """Empties one archived file in place, keeping its name; returns the bytes freed.

    Only when ``path`` is still the regular, single-link file ``expected`` (an lstat from a
    scan) describes: never a symlink's target, never a file hard-linked from elsewhere (a
    hostile queue file may be a link to anything), never a file in the middle of a move (a
    move links before it unlinks, so it has two links then). Otherwise, or if the file is
    gone, returns 0 and changes nothing. Idempotent; not fsynced (after a crash a file is
    either emptied or still whole, and the next pass empties it again).
    """
    if not stat.S_ISREG(expected.st_mode) or expected.st_nlink != 1:
        return 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except (FileNotFoundError, IsADirectoryError):
        return 0
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO):  # now a symlink, or a FIFO: not ours to empty
            return 0
        raise
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino) or not stat.S_ISREG(st.st_mode) \
                or st.st_nlink != 1:
            return 0
        os.ftruncate(fd, 0)
        return st.st_size
    finally:
        os.close(fd)


def temp_writer_alive(name: str) -> bool | None:
    """Whether the process that named a temp file lives: known only for a process of this host (same HOST_ID:
    same kernel and PID namespace). A dead writer's file can never be finished, whatever its age; a live one's may
    be being written, whatever its age. Another host's temp files (None) are judged by their age alone."""
    parts = name.split("-")
    if len(parts) != 3 or parts[0] != HOST_ID or not parts[1].isdigit():
        return None
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return None
    return True


def remove_temp(path: str | os.PathLike) -> None:
    """Removes an abandoned temp file (the only deletion in the protocol)."""
    os.unlink(path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

