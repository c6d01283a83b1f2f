"""Multi-node transport: one safetensors file per version on the shared filesystem.

``RUN/weights/snapshots/v{version:08d}.safetensors`` is written to a dot-temp name and
renamed into place, then the version file names it: a reader that sees the version
sees a complete, never-again-modified file, so no locks are needed (and none would be
trustworthy across NFS clients). The newest KEEP snapshots are kept: a reader that read
the version file just before the PS moved on still finds its file; if it was pruned
anyway, the reader re-reads the version file and loads the newer one. Each file carries
its publisher_id and version in the safetensors metadata, and the reader checks them, so
a restarted PS that reuses a version number is never mistaken for the old one.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import time
import uuid

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from asyncgrpo.jobqueue import fileops
from asyncgrpo.jobqueue.rundir import RunDir
from asyncgrpo.weights.adapter import layout_of, shared_tensors
from asyncgrpo.weights.base import (
    Layout,
    TransportUnavailable,
    layout_path,
    log,
    remove_legacy_version_file,
    remove_other_layouts,
    version_path,
)

KEEP = 2


def snapshot_dir(run: RunDir):
    return run.weights / "snapshots"


def snapshot_path(run: RunDir, version: int):
    return snapshot_dir(run) / f"v{version:08d}.safetensors"


class SnapshotPublisher:
    transport = "safetensors"

    def __init__(self, run: RunDir, model: torch.nn.Module):
        self.run, self.model, self.host = run, model, socket.gethostname()
        self.publisher_id = uuid.uuid4().hex
        self.layout = layout_of(model)  # the whole model, or a PEFT model's adapter only (adapter.py)
        self._version: int | None = None
        self._written: collections.deque = collections.deque()
        snapshot_dir(run).mkdir(exist_ok=True)
        # Snapshots and temp files of earlier PS runs: one PS per run directory, so they are dead.
        for entry in fileops.scan(snapshot_dir(run)):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        remove_other_layouts(run, keep=self.publisher_id)
        remove_legacy_version_file(run)
        fileops.write_json(layout_path(run, self.publisher_id), self.layout.to_json())

    def publish(self, version: int, step: int) -> bool:
        if self._version is not None and version <= self._version:
            raise ValueError(f"versions must increase: {version} after {self._version}")
        with torch.no_grad():
            sources = self.layout.sources(shared_tensors(self.model))
            tensors = {e.name: t.detach().contiguous() for e, t in zip(self.layout.entries, sources, strict=True)}
        path = snapshot_path(self.run, version)
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        t0 = time.perf_counter()
        try:
            save_file(tensors, str(tmp), metadata={"publisher_id": self.publisher_id, "version": str(version)})
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fileops.write_json(version_path(self.run), {
            "version": version, "step": step, "transport": self.transport, "publisher_id": self.publisher_id,
            "pid": os.getpid(), "host": self.host, "written_at": time.time(), "buffer": None, "closed": False,
            "layout_file": layout_path(self.run, self.publisher_id).name, "path": str(path),
            "total_bytes": self.layout.total_bytes, "num_tensors": len(self.layout.entries)})
        self._version = version
        self._written.append(path)
        while len(self._written) > KEEP:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._written.popleft())
        log.debug("[weights] published v%d step %d snapshot write_ms=%.1f", version, step,
                  (time.perf_counter() - t0) * 1e3)
        return True

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
        # safe_open opens the file twice (header, then torch's mmap): the PS may prune it in
        # between. Holding our own descriptor and opening through /proc/self/fd pins the file.
        fd = os.open(path, os.O_RDONLY)  # FileNotFoundError: pruned already, the caller re-reads
        try:
            pinned = f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else str(path)
            with safe_open(pinned, framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                if meta.get("publisher_id") != info["publisher_id"] or meta.get("version") != str(info["version"]):
                    raise FileNotFoundError(f"{path} belongs to another publisher or version")
                for dst, i in zip(dsts, idx, strict=True):
                    dst.copy_(f.get_tensor(self.layout.entries[i].name))
        except (SafetensorError, RuntimeError) as err:
            if not path.exists():
                raise FileNotFoundError(str(path)) from err
            raise TransportUnavailable(f"{path}: {err}") from err
        finally:
            os.close(fd)

    def close(self) -> None:
        pass
