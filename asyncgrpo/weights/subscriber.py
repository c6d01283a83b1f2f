"""The worker side: one Subscriber for every transport (the version file says which).

A Subscriber keeps one open reader per PS run (publisher_id): mmap files mapped once,
CUDA IPC handles opened once. A new publisher_id (the PS restarted) drops it and opens
the new one. When a reader cannot be opened (the PS died, its buffers are gone, the GPU
is not visible) ``sync`` returns None, the model keeps its weights, and the same
publisher is retried at most every RETRY_S seconds; a new publisher is tried at once. A
worker on another host than the PS reads only safetensors snapshots (mmap buffers and CUDA
IPC handles exist on the PS's host alone): for any other transport it logs one line saying
so and waits, without weights, never claiming a job.
``on_read`` is told which snapshot is about to be read, and when the read is over (the
worker records it in its heartbeat, so that the PS does not delete it meanwhile); ``on_bad_delta``, after
each read of snapshots, the delta bad on disk the reader waits past, or None (the PS, told so by the
heartbeat, publishes an anchor at once).
See base.py for why a copy is never torn. A copy that fails because this process's own
GPU is broken is not caught here: it propagates to the worker, which exits.

A model that cannot take the published weights (another architecture, another base model
under a LoRA adapter, an adapter on one side only) raises ``WeightsMismatch`` with one line:
the worker exits with status 2 rather than generate from a different model.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import time
from collections.abc import Callable

import torch

from asyncgrpo.run.hosts import same_host
from asyncgrpo.run.rundir import RunDir
from asyncgrpo.weights.adapter import check_model, shared_tensors
from asyncgrpo.weights.base import (
    Layout,
    TransportUnavailable,
    flocked_patiently,
    key,
    log,
    open_lock,
    read_version_file,
)
from asyncgrpo.weights.layout import WeightsOutOfReach

MAX_ATTEMPTS = 8  # re-reads when the PS moves on between our read and our lock; each costs microseconds
RETRY_S = 5.0
_READERS = {"mmap": "asyncgrpo.weights.mmap_file:MmapReader",
            "safetensors": "asyncgrpo.weights.snapshot:SnapshotReader",
            "cuda_ipc": "asyncgrpo.weights.cuda_ipc:CudaIpcReader"}


class Subscriber:
    def __init__(self, run: RunDir, on_read: Callable[[tuple[str, int] | None], None] | None = None,
                 on_bad_delta: Callable[[tuple[str, int] | None], None] | None = None):
        self.run = run
        self._on_read = on_read or (lambda _snapshot: None)
        self._on_bad_delta = on_bad_delta or (lambda _delta: None)
        self._lock_fds: dict[int, int] = {}
        self._reader = None
        self._reader_id: str | None = None
        self._synced: tuple[str, int] | None = None  # (publisher_id, version) now in the model
        self.synced_bytes = 0  # what the last sync read: the weights' size (safetensors: the files it read)
        self._failed: tuple[str, float] | None = None  # (publisher_id, retry after)
        self._checked: tuple[str, int] | None = None  # (publisher_id, id(model)) whose base check passed

    def latest_version(self) -> int | None:
        info = read_version_file(self.run)
        return None if info is None or info.get("closed") else info["version"]

    def sync(self, model: torch.nn.Module) -> int | None:
        t0 = time.perf_counter()
        for _ in range(MAX_ATTEMPTS):
            info = read_version_file(self.run)
            if info is not None and info.get("closed") and self._reader_id == info["publisher_id"]:
                self._drop_reader()  # unmap a closed PS's buffers (GPU memory stays held while mapped)
            if info is None or info.get("closed") or info.get("rewriting") or not self._is_new(info):
                return None  # rewriting: the PS is rewriting the named slot in place (base.py)
            reader = self._reader_for(info)
            if reader is None:
                return None
            if self._checked != (info["publisher_id"], id(model)):  # once per publisher: a base is frozen
                check_model(reader.layout, model)  # WeightsMismatch: another base model, or adapter on one side
                self._checked = (info["publisher_id"], id(model))
            dsts, idx = reader.layout.destinations(shared_tensors(model))  # WeightsMismatch: wrong model
            try:
                with torch.no_grad():
                    if reader.uses_slots:
                        with flocked_patiently(self._lock(info["buffer"]), fcntl.LOCK_SH,
                                               f"the parameter server to finish writing weights slot {info['buffer']}"):
                            if key(read_version_file(self.run)) != key(info):
                                continue  # the PS moved on (or closed): read the file again
                            reached = reader.copy_out(info, dsts, idx)
                    else:
                        self._on_read((info["publisher_id"], reader.first_version(info)))
                        try:
                            reached = reader.copy_out(info, dsts, idx)  # files: maybe short of info's version
                        finally:
                            self._on_read(None)
                        bad = reader.waiting_past
                        self._on_bad_delta(None if bad is None else (info["publisher_id"], bad))
            except FileNotFoundError:
                continue  # a snapshot was pruned under us: a newer one is named now
            except TransportUnavailable as err:
                self._give_up(info, f"cannot read v{info['version']}: {err}")
                return None
            synced = (info["publisher_id"], info["version"] if reached is None else reached)
            if synced == self._synced:
                return None  # the files did not take it further (a bad delta: the reader said so)
            self._synced = synced
            self.synced_bytes = reader.read_bytes
            log.debug("[weights] synced v%d %s sync_ms=%.2f", synced[1], info["transport"],
                      (time.perf_counter() - t0) * 1e3)
            return synced[1]
        return None

    def _is_new(self, info: dict) -> bool:
        if self._synced is None or self._synced[0] != info["publisher_id"]:
            return True  # a restarted PS may count from a lower version: its weights are new all the same
        return info["version"] > self._synced[1]

    def _reader_for(self, info: dict):
        pid = info["publisher_id"]
        if self._reader is not None and self._reader_id == pid:
            if self._reader.usable(info):
                return self._reader
            self._give_up(info, "the publisher is gone")
            return None
        if self._failed is not None and self._failed[0] == pid and time.monotonic() < self._failed[1]:
            return None
        self._drop_reader()
        names_a_host = "host_id" in info or "host" in info  # (a file without either is checked by its reader)
        if info["transport"] != "safetensors" and names_a_host and not same_host(info):
            raise WeightsOutOfReach(f"the parameter server on host {info.get('host')} publishes its weights through "
                                    f"{info['transport']}, which only its own host can read: workers on other hosts "
                                    "need the PS started with --weight_transport safetensors")
        module, _, cls = _READERS[info["transport"]].partition(":")
        try:
            layout = Layout.load(self.run, pid)
            reader = getattr(importlib.import_module(module), cls)(self.run, info, layout)
            if not reader.usable(info):
                raise TransportUnavailable("the publisher is gone")
        except (TransportUnavailable, OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
            self._give_up(info, f"cannot open: {err}")
            return None
        self._reader, self._reader_id, self._failed = reader, pid, None
        log.info("[weights] opened %s weights of publisher %s (pid %s, %d tensors, %.1f MB)", info["transport"],
                 pid[:8], info.get("pid"), len(layout.entries), layout.total_bytes / 1e6)
        return reader

    def _give_up(self, info: dict, why: str) -> None:
        if self._failed is None or self._failed[0] != info["publisher_id"]:
            log.warning("[weights] %s publisher %s: %s; keeping %s", info["transport"], info["publisher_id"][:8],
                        why, "the current weights" if self._synced else "the weights it loaded (none synced yet)")
        self._drop_reader()
        self._failed = (info["publisher_id"], time.monotonic() + RETRY_S)

    def _drop_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader, self._reader_id = None, None

    def _lock(self, slot: int) -> int:
        if slot not in self._lock_fds:
            self._lock_fds[slot] = open_lock(self.run, slot)
        return self._lock_fds[slot]

    def close(self) -> None:
        self._drop_reader()
        for fd in self._lock_fds.values():
            os.close(fd)
        self._lock_fds.clear()
