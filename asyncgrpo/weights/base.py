"""What the transports share: the version file, the slot locks, the two-slot protocol, the PS side.

Files (all under ``RUN/weights/``):

* ``ps_ipc_handle_version.json``: the newest published version (small; rewritten atomically
  with ``fileops.write_json`` on every publish): version, step, transport, publisher_id, pid,
  host, written_at, buffer (slot 0/1), closed, layout_file, and the transport's fields.
* ``layout-{publisher_id}.json``: names, dtypes, shapes, byte offsets, grouped per dtype;
  written once per PS run. It is a file of its own because it grows with the model (a
  large model's layout outgrows the 64 KiB that ``fileops.read_json`` reads) and does not
  change between versions, so workers parse it once, not on every check.
* ``buffer0.lock``, ``buffer1.lock``: one reader/writer lock (flock) per slot.

The slot protocol (mmap and cuda_ipc). The PS owns two buffers (slots); each holds every
tensor, grouped by dtype.

  PS, publish(v):  s = the slot the version file does NOT name (0 at first)
                   flock(lock[s], EX); copy weights into slot s and wait for the copy
                   to finish; rewrite the version file to (v, s); unlock
  worker, sync():  read the version file -> (v, s); flock(lock[s], SH);
                   re-read the version file; if it still says (publisher, v, s):
                   copy slot s out, wait for the copy; unlock -> return v
                   else: unlock and start over (the PS moved on), a few times at most

Why no worker ever copies a torn or mislabelled version: the PS rewrites buffer s and the
version file naming s only inside one EX section of lock[s]. A worker that holds SH on
lock[s] and reads "(v, s)" knows that the last EX section on s ended by writing exactly
that line (a later one would have written a later version, versions strictly increase
within a publisher, and a new publisher has a new publisher_id and its own buffers), and
no EX section on s can start until it unlocks. Because the PS writes into the slot the
file does not name, a PS that dies in the middle of a copy leaves the file naming the
other, complete slot; a failed copy or version-file write leaves the file unchanged too.

A failed publish (an exception after the copy, a full disk for the version file) does not
advance the PS's idea of the named slot either, so its next publish goes to the same
unnamed slot again.

Why the PS is never held up for long: workers read the file first and lock the slot it
names, which is the other slot than the one the PS is about to write. The only readers
the PS can wait for are those that read the file before the previous publish: at most
one copy. Workers never hold a lock across anything but one copy.

Closing: the PS takes EX on both slots, marks the version file ``closed`` and only then
frees its buffers, so no worker copies from freed (CUDA: possibly reused) memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import time
import uuid

import torch

from asyncgrpo.jobqueue import fileops
from asyncgrpo.jobqueue.rundir import RunDir
from asyncgrpo.weights.layout import Layout, layout_path
from asyncgrpo.weights.memcopy import copy_tensors

VERSION_FILE = "ps_ipc_handle_version.json"
TRANSPORTS = ("mmap", "cuda_ipc", "safetensors")
NUM_SLOTS = 2
_ID_RE = re.compile(r"^[0-9a-f]{32}$")

log = logging.getLogger("asyncgrpo.weights")


class TransportUnavailable(Exception):
    """The published weights cannot be read from here right now (not a bug in the caller)."""


def version_path(run: RunDir):
    return run.weights / VERSION_FILE


def lock_path(run: RunDir, slot: int):
    return run.weights / f"buffer{slot}.lock"


def open_lock(run: RunDir, slot: int) -> int:
    return os.open(lock_path(run, slot), os.O_RDWR | os.O_CREAT, 0o644)


@contextlib.contextmanager
def flocked(fd: int, mode: int):
    fcntl.flock(fd, mode)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def pid_alive(pid: object, host: object) -> bool:
    """False only when ``pid`` is certainly dead on this host (another host: unknown, True)."""
    if host != socket.gethostname():
        return True
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_version_file(run: RunDir) -> dict | None:
    """The version file, validated; None when missing, unreadable or malformed."""
    info = fileops.read_json(version_path(run))
    if info is None:
        return None
    slot_ok = info.get("buffer") is None if info.get("transport") == "safetensors" else info.get("buffer") in (0, 1)
    ok = (isinstance(info.get("version"), int) and info.get("transport") in TRANSPORTS and slot_ok
          and isinstance(info.get("publisher_id"), str) and _ID_RE.match(info["publisher_id"]))
    return info if ok else None


def key(info: dict | None) -> tuple | None:
    """What must not change between a worker's first read and its re-read under the lock."""
    if info is None:
        return None
    return info["publisher_id"], info["version"], info.get("buffer"), bool(info.get("closed"))


class SlotPublisher:
    """The PS side of the slot protocol; subclasses own the two buffers (``self.slots``,
    flat uint8 tensors) and say how a copy completes and what readers need to open them."""

    transport = ""

    def __init__(self, run: RunDir, model: torch.nn.Module):
        self.run, self.model = run, model
        self.publisher_id = uuid.uuid4().hex
        self.layout = Layout.of(model.state_dict())
        self.slots: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] = []
        self._lock_fds = [open_lock(run, i) for i in range(NUM_SLOTS)]
        self._slot: int | None = None  # the slot the version file names
        self._version: int | None = None
        self._closed = False
        remove_other_layouts(run, keep=self.publisher_id)
        fileops.write_json(layout_path(run, self.publisher_id), self.layout.to_json())

    def _set_slots(self, slots: list[torch.Tensor]) -> None:
        self.slots = slots
        self._views = [self.layout.views(s) for s in slots]

    def _copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Copies and returns only when the data is in the slot (CUDA: synchronised)."""
        copy_tensors(dsts, srcs)

    def _fields(self) -> dict:
        return {}

    def publish(self, version: int, step: int) -> None:
        if self._closed:
            raise RuntimeError("publish() after close()")
        if self._version is not None and version <= self._version:
            raise ValueError(f"versions must increase: {version} after {self._version}")
        slot = 0 if self._slot is None else 1 - self._slot
        t0 = time.perf_counter()
        with torch.no_grad():
            sources = self.layout.sources(self.model.state_dict())
            with flocked(self._lock_fds[slot], fcntl.LOCK_EX):
                t1 = time.perf_counter()
                self._copy(self._views[slot], sources)
                self._write(version, step, slot, closed=False)
        self._slot, self._version = slot, version
        log.debug("[weights] published v%d step %d slot %d lock_wait_ms=%.2f copy_ms=%.2f %s",
                  version, step, slot, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, self.transport)

    def _write(self, version: int, step: int, slot: int, *, closed: bool) -> None:
        fileops.write_json(version_path(self.run), {
            "version": version, "step": step, "transport": self.transport, "publisher_id": self.publisher_id,
            "pid": os.getpid(), "host": socket.gethostname(), "written_at": time.time(), "buffer": slot,
            "closed": closed, "layout_file": layout_path(self.run, self.publisher_id).name,
            "total_bytes": self.layout.total_bytes, "num_tensors": len(self.layout.entries), **self._fields()})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with flocked(self._lock_fds[0], fcntl.LOCK_EX), flocked(self._lock_fds[1], fcntl.LOCK_EX):
            current = read_version_file(self.run)
            if current is not None and current["publisher_id"] == self.publisher_id:
                self._write(current["version"], current["step"], current["buffer"], closed=True)
            self._release()  # no worker holds a slot now, and none will copy from a closed publisher
        for fd in self._lock_fds:
            os.close(fd)
        self.slots, self._views = [], []

    def _release(self) -> None:
        """Frees the transport's resources; called under both EX locks."""


def remove_other_layouts(run: RunDir, keep: str) -> None:
    """Layout files of earlier PS runs (one PS per run directory: they are all dead)."""
    for entry in fileops.scan(run.weights):
        if entry.name.startswith("layout-") and entry.name != f"layout-{keep}.json":
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
