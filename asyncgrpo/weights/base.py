"""What the transports share: the version file, the slot locks, the two-slot protocol, the PS side.

Files (all under ``RUN/weights/``):

* ``published_version.json``: the newest published version (small; rewritten atomically
  with ``fileops.write_json`` on every publish): version, step, transport, publisher_id, pid,
  host, host_id (run/hosts.py), written_at, buffer (slot 0/1), closed, rewriting, layout_file, and the transport's
  fields.
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

A reader that stops while holding a slot's lock (SIGSTOP, a debugger, a hung host) would
block the PS's next publish into that slot forever. So the PS waits at most
``slot_wait_s`` for a lock, then logs who holds it and rewrites the slot the file names
in place instead, under that slot's EX lock: it first marks the file ``rewriting`` (a
reader skips such a version and keeps its weights, so a PS that dies in the middle of the
copy leaves nothing torn to read), copies, then names the new version. Later publishes
try the held slot without waiting and go back to it once it is free. When both slots are
held, the version is not published (publish returns False, an error is logged) and the
workers keep the last one. The stopped reader itself copies a slot nobody has rewritten
since it locked it.

Closing: the PS takes EX on both slots, marks the version file ``closed`` and only then
frees its buffers, so no worker copies from freed (CUDA: possibly reused) memory. A slot
whose lock stays held past ``slot_wait_s`` is left allocated (the transport decides how).
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
from pathlib import Path

import torch

from asyncgrpo.messages import first_line
from asyncgrpo.run import fileops
from asyncgrpo.run.hosts import HOST_ID
from asyncgrpo.run.rundir import RunDir
from asyncgrpo.weights.adapter import layout_of, shared_tensors
from asyncgrpo.weights.layout import Layout, layout_path  # noqa: F401 (Layout: imported from here by the transports)
from asyncgrpo.weights.memcopy import copy_tensors

VERSION_FILE = "published_version.json"
SLOT_WAIT_S = 10.0  # longest wait for a slot's lock: a healthy reader holds it for one copy
TRANSPORTS = ("cuda_ipc", "mmap", "safetensors")  # --weight_transport's choices, with "auto" (asyncgrpo/config.py)
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
    return os.open(lock_path(run, slot), os.O_RDWR | os.O_CREAT, 0o666)


LOCK_WAIT_REPORT_S = 60.0  # how often a process blocked on a lock says what it waits for


@contextlib.contextmanager
def flocked_patiently(fd: int, mode: int, what: str, report_every_s: float = LOCK_WAIT_REPORT_S):
    """Holds the flock for the block, saying every ``report_every_s`` what it waits for and since when: a holder
    stopped (SIGSTOP, swapped out) holds the lock for as long, and is waited for, since it may go on."""
    started = time.monotonic()
    while not flock_within(fd, mode, report_every_s):
        log.warning("[weights] waiting %.0f s so far for %s", time.monotonic() - started, what)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def flock_within(fd: int, mode: int, timeout_s: float) -> bool:
    """Takes the lock, waiting at most ``timeout_s`` (0: one try); False if it stayed held.
    flock has no timeout of its own (and SIGALRM works in the main thread only): poll."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0002
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.005)  # a healthy holder lets go within one copy


def lock_holders(path: str | os.PathLike) -> list[int]:
    """Pids holding a lock on the file, from /proc/locks (this host, best effort: for a log line)."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        fields = line.split()  # "1: FLOCK  ADVISORY  READ 5569 fe:00:2147586 0 EOF"; waiters have "->"
        if len(fields) > 5 and "->" not in fields and fields[5] == inode and fields[4].isdigit():
            pids.append(int(fields[4]))
    return sorted(set(pids))


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
    return (info["publisher_id"], info["version"], info.get("buffer"), bool(info.get("closed")),
            bool(info.get("rewriting")))


class SlotPublisher:
    """The PS side of the slot protocol; subclasses own the two buffers (``self.slots``,
    flat uint8 tensors) and say how a copy completes and what readers need to open them."""

    transport = ""

    def __init__(self, run: RunDir, model: torch.nn.Module):
        self.run, self.model = run, model
        self.publisher_id = uuid.uuid4().hex
        self.layout = layout_of(model)  # the whole model, or a PEFT model's adapter only (adapter.py)
        self.published_bytes = self.layout.total_bytes  # what each publish copies
        self.slot_wait_s = SLOT_WAIT_S
        self.slots: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] = []
        self._lock_fds = [open_lock(run, i) for i in range(NUM_SLOTS)]
        self._slot: int | None = None  # the slot the version file names
        self._version: int | None = None
        self._step: int | None = None
        self._held: set[int] = set()  # slots whose lock a reader kept past slot_wait_s
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

    def publish(self, version: int, step: int, tensors: dict[str, torch.Tensor] | None = None) -> bool:
        """True once the version file names ``version``; False when both slots are held by
        stopped readers (the workers keep the last published version; logged). ``tensors``: what
        to publish when it is not the model's own (``gather_full_tensors`` of a sharded model)."""
        if self._closed:
            raise RuntimeError("publish() after close()")
        if self._version is not None and version <= self._version:
            raise ValueError(f"versions must increase: {version} after {self._version}")
        t0 = time.perf_counter()
        with torch.no_grad():
            sources = self.layout.sources(shared_tensors(self.model) if tensors is None else tensors)
            slot = self._lock_a_slot(version)
            if slot is None:
                return False
            try:
                t1 = time.perf_counter()
                if slot == self._slot:  # in place: readers skip it until the new version is named
                    self._write(self._version, self._step, slot, closed=False, rewriting=True)
                self._copy(self._views[slot], sources)
                self._write(version, step, slot, closed=False)
            finally:
                fcntl.flock(self._lock_fds[slot], fcntl.LOCK_UN)
        self._slot, self._version, self._step = slot, version, step
        log.debug("[weights] published v%d step %d slot %d lock_wait_ms=%.2f copy_ms=%.2f %s",
                  version, step, slot, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, self.transport)
        return True

    def _lock_a_slot(self, version: int) -> int | None:
        """Locks (EX) the slot to write: the one the file does not name, or, when a reader
        has held that one past ``slot_wait_s``, the named one (rewritten in place)."""
        unnamed = 0 if self._slot is None else 1 - self._slot
        for slot in (unnamed, 1 - unnamed):
            was_held = slot in self._held
            if flock_within(self._lock_fds[slot], fcntl.LOCK_EX, 0.0 if was_held else self.slot_wait_s):
                if was_held:
                    self._held.discard(slot)
                    log.info("[weights] slot %d is free again", slot)
                return slot
            if not was_held:
                self._held.add(slot)
                log.warning("[weights] slot %d: its lock has been held for over %.1f s by pid(s) %s (a stopped "
                            "or hung worker?); publishing without it until it is free", slot, self.slot_wait_s,
                            lock_holders(lock_path(self.run, slot)) or "unknown")
        log.error("[weights] version %d not published: both slots are held by readers that do not let go "
                  "(pids %s, %s); workers keep version %s", version, lock_holders(lock_path(self.run, 0)) or "?",
                  lock_holders(lock_path(self.run, 1)) or "?", self._version)
        return None

    def _write(self, version: int | None, step: int | None, slot: int, *, closed: bool,
               rewriting: bool = False) -> None:
        fileops.write_json(version_path(self.run), {
            "version": version, "step": step, "transport": self.transport, "publisher_id": self.publisher_id,
            "pid": os.getpid(), "host": socket.gethostname(), "host_id": HOST_ID, "written_at": time.time(),
            "buffer": slot,
            "closed": closed, "rewriting": rewriting, "layout_file": layout_path(self.run, self.publisher_id).name,
            "total_bytes": self.layout.total_bytes, "num_tensors": len(self.layout.entries), **self._fields()})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        locked = [slot for slot in range(NUM_SLOTS) if flock_within(
            self._lock_fds[slot], fcntl.LOCK_EX, 0.0 if slot in self._held else self.slot_wait_s)]
        held = set(range(NUM_SLOTS)) - set(locked)
        if held:
            log.warning("[weights] closing while slot(s) %s are held by pid(s) %s: left allocated for them",
                        sorted(held), [lock_holders(lock_path(self.run, s)) for s in sorted(held)])
        try:
            current = read_version_file(self.run)
            if current is not None and current["publisher_id"] == self.publisher_id:
                self._write(current["version"], current["step"], current["buffer"], closed=True)
        except OSError as err:  # a full disk, say: the buffers go all the same (workers see this PS's pid gone)
            log.warning("[weights] could not mark the version file closed: %s", first_line(err))
        try:
            self._release(held)  # no worker copies from a closed publisher, and none holds a freed slot
        finally:
            for fd in self._lock_fds:
                os.close(fd)  # drops our locks
        self.slots, self._views = [], []

    def _release(self, held: set[int]) -> None:
        """Frees the transport's resources; called under EX on every slot but those in
        ``held`` (a stopped reader may still copy from them when it resumes)."""


def remove_other_layouts(run: RunDir, keep: str) -> None:
    """Layout files of earlier PS runs (one PS per run directory: they are all dead)."""
    for entry in fileops.scan(run.weights):
        if entry.name.startswith("layout-") and entry.name != f"layout-{keep}.json":
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
