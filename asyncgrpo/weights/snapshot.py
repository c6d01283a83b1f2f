"""Workers on other hosts: one safetensors file per version on the shared filesystem.

``RUN/weights/snapshots/v{version:08d}.safetensors`` is written to a dot-temp name and
renamed into place, then the version file names it: a reader that sees the version
sees a complete, never-again-modified file, so no locks are needed (and none would be
trustworthy across NFS clients). Each file carries its publisher_id and version in the
safetensors metadata, and the reader checks them, so a restarted PS that reuses a version
number is never mistaken for the old one.

Deleting old snapshots. A worker records in its heartbeat the snapshot it is about to read
(``WorkerPresence.announce_read``, written before it opens the file); after each publish the
PS deletes every snapshot but the newest KEEP and those a live worker's heartbeat names
(alive as liveness.py judges it, with a lease of READER_LEASE_S). So a live worker's read is
never cut short, on any host. The one window left: a worker that names a snapshot just after
the PS looked. Its file may then vanish under it, which is why a reader never maps the file
(a mapped page of a file deleted on an NFS server is a SIGBUS): it reads the whole file with
plain reads, which either return the file's bytes or fail (ENOENT, ESTALE), and on failure
the reader reads the version file again and takes the newer snapshot, which stays. The cost
is a transient second copy of the weights in host memory while one is read.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import re
import socket
import time
import uuid

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from asyncgrpo.run import fileops
from asyncgrpo.run.hosts import HOST_ID
from asyncgrpo.run.liveness import DEFAULT_LEASE_S, fs_now, list_workers
from asyncgrpo.run.rundir import RunDir
from asyncgrpo.weights.adapter import layout_of, shared_tensors
from asyncgrpo.weights.base import (
    Layout,
    TransportUnavailable,
    layout_path,
    log,
    remove_other_layouts,
    version_path,
)

KEEP = 2
# A reader on another host protects its snapshot while its heartbeat is younger than this. Only
# the disk space of one snapshot per reader hangs on it: a reader that loses its file re-reads.
READER_LEASE_S = DEFAULT_LEASE_S


def snapshot_dir(run: RunDir):
    return run.weights / "snapshots"


def snapshot_path(run: RunDir, version: int):
    return snapshot_dir(run) / f"v{version:08d}.safetensors"


def versions_being_read(run: RunDir, publisher_id: str) -> set[int]:
    """The versions of ``publisher_id`` that live workers' heartbeats say they are reading."""
    return {w.reading[1] for w in list_workers(run, fs_now(run), READER_LEASE_S)
            if w.reading is not None and w.reading[0] == publisher_id}


class SnapshotPublisher:
    transport = "safetensors"

    def __init__(self, run: RunDir, model: torch.nn.Module):
        self.run, self.model, self.host = run, model, socket.gethostname()
        self.publisher_id = uuid.uuid4().hex
        self.layout = layout_of(model)  # the whole model, or a PEFT model's adapter only (adapter.py)
        self._version: int | None = None
        self._written: collections.deque = collections.deque()  # (version, path), oldest first
        snapshot_dir(run).mkdir(exist_ok=True)
        # Snapshots and temp files of earlier PS runs: one PS per run directory, so they are dead.
        for entry in fileops.scan(snapshot_dir(run)):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        remove_other_layouts(run, keep=self.publisher_id)
        fileops.write_json(layout_path(run, self.publisher_id), self.layout.to_json())

    def publish(self, version: int, step: int, tensors: dict[str, torch.Tensor] | None = None) -> bool:
        if self._version is not None and version <= self._version:
            raise ValueError(f"versions must increase: {version} after {self._version}")
        with torch.no_grad():
            sources = self.layout.sources(shared_tensors(self.model) if tensors is None else tensors)
            tensors = {e.name: t.detach().contiguous() for e, t in zip(self.layout.entries, sources, strict=True)}
        path = snapshot_path(self.run, version)
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        t0 = time.perf_counter()
        try:
            try:
                save_file(tensors, str(tmp), metadata={"publisher_id": self.publisher_id, "version": str(version)})
            except SafetensorError as err:  # "I/O error: No space left on device (os error 28)": say so, and where
                found = re.search(r"\(os error (\d+)\)", str(err))
                if found is None:
                    raise
                raise OSError(int(found.group(1)), os.strerror(int(found.group(1))), str(path)) from err
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fileops.write_json(version_path(self.run), {
            "version": version, "step": step, "transport": self.transport, "publisher_id": self.publisher_id,
            "pid": os.getpid(), "host": self.host, "host_id": HOST_ID, "written_at": time.time(), "buffer": None,
            "closed": False, "layout_file": layout_path(self.run, self.publisher_id).name, "path": str(path),
            "total_bytes": self.layout.total_bytes, "num_tensors": len(self.layout.entries)})
        self._version = version
        self._written.append((version, path))
        self._prune()
        log.debug("[weights] published v%d step %d snapshot write_ms=%.1f", version, step,
                  (time.perf_counter() - t0) * 1e3)
        return True

    def _prune(self) -> None:
        """Deletes the snapshots older than the newest KEEP that no live worker is reading."""
        if len(self._written) <= KEEP:
            return
        being_read = versions_being_read(self.run, self.publisher_id)
        newest = list(self._written)[-KEEP:]
        kept = collections.deque()
        for version, path in self._written:
            if (version, path) in newest or version in being_read:
                kept.append((version, path))
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._written = kept

    def close(self) -> None:
        """Nothing to free: the last snapshots stay loadable (workers elsewhere may still want them)."""


class SnapshotReader:
    uses_slots = False

    def __init__(self, run: RunDir, info: dict, layout: Layout):
        self.run, self.layout = run, layout

    def usable(self, info: dict) -> bool:
        return True

    def copy_out(self, info: dict, dsts: list[torch.Tensor], idx: list[int]) -> None:
        path = snapshot_path(self.run, info["version"])  # derived, never a path read from the file
        try:
            with open(path, "rb") as f:  # plain reads, never a mapping (module docstring)
                data = f.read()
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ESTALE):
                raise FileNotFoundError(f"{path} was deleted (a newer snapshot is named now)") from err
            raise TransportUnavailable(f"{path}: {err}") from err
        try:
            meta = _metadata(data)
            if meta.get("publisher_id") != info["publisher_id"] or meta.get("version") != str(info["version"]):
                raise FileNotFoundError(f"{path} belongs to another publisher or version")
            tensors = load(data)
            for dst, i in zip(dsts, idx, strict=True):
                dst.copy_(tensors[self.layout.entries[i].name])
        except (SafetensorError, ValueError, KeyError, RuntimeError) as err:
            raise TransportUnavailable(f"{path}: {err}") from err

    def close(self) -> None:
        pass


def _metadata(data: bytes) -> dict:
    """The ``__metadata__`` of a safetensors file's header: 8 bytes of length, then JSON."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    return header.get("__metadata__") or {}
