"""CPU transport: two files in /dev/shm, mapped shared by the PS and every worker.

Both sides map the same pages with ``torch.from_file(path, shared=True)``: the PS copies
its parameters into its mapping (one memcpy per tensor), a worker copies from its mapping
into its model (one memcpy per tensor); nothing is serialised, nothing goes through a
pipe. Files live in ``/dev/shm/asyncgrpo-weights-{hash of the run dir}-{publisher_id}/``
(two runs, or two PS runs of one run, never collide); in ``RUN/weights/`` instead when
/dev/shm is missing or too small (a container's default /dev/shm is 64 MB).

The PS reserves the files' pages up front (posix_fallocate): a full tmpfs then fails the
constructor with ENOSPC instead of killing the PS with SIGBUS in the middle of a publish.
close() removes the folder; folders of earlier PS runs of this run directory whose owner
is dead are removed when a new publisher starts. A worker that still maps a removed file
keeps reading valid pages (tmpfs frees them at the last unmap), but the version file says
``closed`` by then, so it doesn't.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import mmap
import os
import shutil
import socket
import time
from pathlib import Path

import torch

from asyncgrpo.jobqueue import fileops
from asyncgrpo.jobqueue.rundir import RunDir
from asyncgrpo.weights.base import NUM_SLOTS, Layout, SlotPublisher, log, pid_alive
from asyncgrpo.weights.memcopy import copy_tensors

SHM_ROOT = Path("/dev/shm")
PREFIX = "asyncgrpo-weights-"
_ORPHAN_GRACE_S = 60.0  # a folder without owner.json may be one being created right now
_MADV_POPULATE = {False: 22, True: 23}  # MADV_POPULATE_READ / _WRITE (Linux >= 5.14)
_libc = ctypes.CDLL(None, use_errno=True)


def run_tag(run: RunDir) -> str:
    return hashlib.sha1(str(run.root.resolve()).encode()).hexdigest()[:12]


def buffer_dir(base: Path, run: RunDir, publisher_id: str) -> Path:
    return base / f"{PREFIX}{run_tag(run)}-{publisher_id}"


def _choose_base(run: RunDir, nbytes: int) -> Path:
    if SHM_ROOT.is_dir() and os.access(SHM_ROOT, os.W_OK):
        free = shutil.disk_usage(SHM_ROOT).free
        if free >= NUM_SLOTS * nbytes + (64 << 20):
            return SHM_ROOT
        log.warning("[weights] %s has %.0f MB free, %d buffers of %.0f MB need more; using %s (slower)",
                    SHM_ROOT, free / 1e6, NUM_SLOTS, nbytes / 1e6, run.weights)
    return run.weights


def _remove_dead_folders(base: Path, run: RunDir, keep: Path) -> None:
    for folder in base.glob(f"{PREFIX}{run_tag(run)}-*"):
        if folder == keep or not folder.is_dir():
            continue
        owner = fileops.read_json(folder / "owner.json")
        if owner is not None and pid_alive(owner.get("pid"), owner.get("host")):
            continue
        with contextlib.suppress(OSError):
            if owner is None and time.time() - folder.stat().st_mtime < _ORPHAN_GRACE_S:
                continue
            shutil.rmtree(folder)
            log.info("[weights] removed %s (its PS is gone)", folder)


def _map(path: str | Path, nbytes: int, *, write: bool) -> torch.Tensor:
    """Maps the file and fills in its page tables now: otherwise the first publish (and each
    worker's first sync) into a slot pays one page fault per 4 KiB, seconds for a few GB."""
    flat = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    start = flat.data_ptr() - flat.data_ptr() % mmap.PAGESIZE
    length = flat.data_ptr() + nbytes - start
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE[write]) != 0 and write:
        flat.zero_()  # older kernel: touch every page by hand (readers just fault lazily)
    return flat


def _create(path: Path, nbytes: int) -> torch.Tensor:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        hint = " (full)" if err.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise OSError(err.errno, f"cannot reserve {nbytes} bytes in {path.parent}{hint}: {err.strerror}") from err
    finally:
        os.close(fd)
    return _map(path, nbytes, write=True)


class MmapPublisher(SlotPublisher):
    transport = "mmap"

    def __init__(self, run: RunDir, model: torch.nn.Module):
        super().__init__(run, model)
        base = _choose_base(run, self.layout.total_bytes)
        self.dir = buffer_dir(base, run, self.publisher_id)
        for b in {SHM_ROOT, run.weights}:  # an earlier PS may have used the other place
            _remove_dead_folders(b, run, keep=self.dir)
        self.dir.mkdir()
        try:
            fileops.write_json(self.dir / "owner.json", {"pid": os.getpid(), "host": socket.gethostname(),
                                                         "run": str(run.root)})
            self.paths = [self.dir / f"slot{i}.bin" for i in range(NUM_SLOTS)]
            self._set_slots([_create(p, self.layout.total_bytes) for p in self.paths])
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        log.info("[weights] mmap publisher %s: %d tensors, 2 x %.1f MB in %s", self.publisher_id[:8],
                 len(self.layout.entries), self.layout.total_bytes / 1e6, self.dir)

    def _fields(self) -> dict:
        return {"paths": [str(p) for p in self.paths]}

    def _release(self) -> None:
        self._set_slots([])
        shutil.rmtree(self.dir, ignore_errors=True)


class MmapReader:
    uses_slots = True

    def __init__(self, run: RunDir, info: dict, layout: Layout):
        self.layout = layout
        paths = info.get("paths")
        if not isinstance(paths, list) or len(paths) != NUM_SLOTS:
            raise ValueError("no buffer paths in the version file")
        # Map only the files this publisher can have made: no path is taken from a file on trust.
        bases = (SHM_ROOT, run.weights)
        views = []
        for i, p in enumerate(paths):
            if p not in {str(buffer_dir(b, run, info["publisher_id"]) / f"slot{i}.bin") for b in bases}:
                raise ValueError(f"unexpected buffer path {p!r}")
            if os.stat(p).st_size < layout.total_bytes:  # from_file(shared=True) would grow it
                raise ValueError(f"{p} is smaller than the layout")
            views.append(layout.views(_map(p, layout.total_bytes, write=False)))
        self.views = views

    def usable(self, info: dict) -> bool:
        return True  # the pages stay valid after the PS dies; the version file names a complete slot

    def copy_out(self, info: dict, dsts: list[torch.Tensor], idx: list[int]) -> None:
        views = self.views[info["buffer"]]
        copy_tensors(dsts, [views[i] for i in idx])

    def close(self) -> None:
        self.views = []
