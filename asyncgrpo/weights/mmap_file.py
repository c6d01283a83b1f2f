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
is dead are removed when a new publisher starts, or by ``queue_tools cleanup``
(buffer_folders.py). A worker that still maps a removed file keeps reading valid pages
(tmpfs frees them at the last unmap), but the version file says ``closed`` by then, so it
doesn't.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import socket
from pathlib import Path

import torch

from asyncgrpo.run import fileops
from asyncgrpo.run.hosts import HOST_ID
from asyncgrpo.run.rundir import RunDir
from asyncgrpo.weights.base import NUM_SLOTS, Layout, SlotPublisher, log
from asyncgrpo.weights.buffer_folders import PREFIX, SHM_ROOT, buffer_dir, remove_dead_folders  # noqa: F401 (PREFIX: bench)
from asyncgrpo.weights.memcopy import copy_tensors

_MADV_POPULATE = {False: 22, True: 23}  # MADV_POPULATE_READ / _WRITE (Linux >= 5.14)
_libc = ctypes.CDLL(None, use_errno=True)


def _choose_base(run: RunDir, nbytes: int) -> Path:
    if SHM_ROOT.is_dir() and os.access(SHM_ROOT, os.W_OK):
        free = shutil.disk_usage(SHM_ROOT).free
        if free >= NUM_SLOTS * nbytes + (64 << 20):
            return SHM_ROOT
        log.warning("[weights] %s has %.0f MB free, %d buffers of %.0f MB need more; using %s (slower)",
                    SHM_ROOT, free / 1e6, NUM_SLOTS, nbytes / 1e6, run.weights)
    return run.weights


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
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        hint = " (full)" if err.errno in fileops.DISK_FULL else ""
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
        remove_dead_folders(run, (SHM_ROOT, run.weights), keep=self.dir)  # an earlier PS may have used either
        self.dir.mkdir()
        try:
            fileops.write_json(self.dir / "owner.json", {"pid": os.getpid(), "host": socket.gethostname(),
                                                         "host_id": HOST_ID, "run": str(run.root)})
            self.paths = [self.dir / f"slot{i}.bin" for i in range(NUM_SLOTS)]
            self._set_slots([_create(p, self.layout.total_bytes) for p in self.paths])
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        log.info("[weights] mmap publisher %s: %d tensors, 2 x %.1f MB in %s", self.publisher_id[:8],
                 len(self.layout.entries), self.layout.total_bytes / 1e6, self.dir)

    def _fields(self) -> dict:
        return {"paths": [str(p) for p in self.paths]}

    def _release(self, held: set[int]) -> None:
        # Even a slot a stopped reader holds can go: its mapping keeps the pages until it unmaps.
        self._set_slots([])
        shutil.rmtree(self.dir, ignore_errors=True)


class MmapReader:
    uses_slots = True

    def __init__(self, run: RunDir, info: dict, layout: Layout):
        self.layout = layout
        self.read_bytes = layout.total_bytes  # every sync copies the whole slot
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
