"""Weight transports: the PS publishes its parameters (with --use_peft: its adapter only), workers
sync them into their model.

    base         version file, locks, the two-slot protocol (why no read is ever torn), the PS side
    buffer_folders  where mmap buffers live; freeing a dead PS's (no torch: queue_tools uses it)
    device_errors   a failed operation vs a broken CUDA context
    layout       where each tensor lives in a flat buffer: grouped per dtype, aligned, ties stored once
    adapter      what is shared: the whole model, or a PEFT model's adapter and its base's fingerprint
    memcopy      copying hundreds of CPU tensors at memory bandwidth
    subscriber   the worker side, for every transport
    mmap_file    CPU: two files in /dev/shm mapped by every process (torch.from_file, shared)
    cuda_ipc     GPU: two buffers on the PS's GPU, IPC handles exported once as JSON
    snapshot     other hosts: one safetensors file per version on the shared filesystem

On the PS, after each optimizer step::

    publisher = make_publisher(run, model)          # once; "auto": cuda_ipc on GPU, else mmap
    publisher.publish(version=step, step=step)      # versions must increase
    # sharded by FSDP2: every rank gathers (adapter.gather_full_tensors), the first publishes
    full = gather_full_tensors(model, keep=rank == 0)
    if rank == 0: publisher.publish(version=step, step=step, tensors=full)
    publisher.close()                               # at exit

On a worker, before each job::

    subscriber = make_subscriber(run)
    version = subscriber.sync(model)                # None: nothing newer (or no PS), weights kept
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from asyncgrpo.run.rundir import RunDir

# Loaded on first use, so that importing a torch-free submodule (buffer_folders, for
# queue_tools) does not import torch through this package.
_LAZY = {"VERSION_FILE": "asyncgrpo.weights.base", "Layout": "asyncgrpo.weights.base",
         "TransportUnavailable": "asyncgrpo.weights.base", "read_version_file": "asyncgrpo.weights.base",
         "WeightsMismatch": "asyncgrpo.weights.layout",
         "WeightsOutOfReach": "asyncgrpo.weights.layout",
         "Subscriber": "asyncgrpo.weights.subscriber"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class WeightPublisher(Protocol):
    publisher_id: str
    transport: str
    published_bytes: int  # what the last publish wrote (safetensors: an anchor, or a delta)

    def publish(self, version: int, step: int, tensors: dict[str, torch.Tensor] | None = None) -> bool:
        """Copies the model's current parameters (or ``tensors``: a sharded model's, gathered whole)
        into the transport, then atomically rewrites RUN/weights/published_version.json to name
        them. False: not published (both slots held by stopped readers; see base.py)."""

    def close(self) -> None: ...


class WeightSubscriber(Protocol):
    def latest_version(self) -> int | None:
        """The published version (None: nothing published, no PS yet, or the PS closed)."""

    def sync(self, model: torch.nn.Module) -> int | None:
        """Copies a version newer than the last synced one into ``model`` in place and
        returns it; None when there is none (or it cannot be read now: weights kept)."""

    def close(self) -> None: ...


def make_publisher(run: RunDir, model: torch.nn.Module, transport: str = "auto",
                   device: torch.device | None = None, dtype: str | None = None) -> WeightPublisher:
    """``device``: where the model trains, when it is not there yet (a model FSDP shards is moved to its GPU
    only when training starts); the model's own device otherwise. ``dtype``: the workers' (--worker_dtype), when
    it is not the model's: safetensors files are written in it (the other transports' copies convert)."""
    import torch

    from asyncgrpo.weights.cuda_ipc import model_device

    device = torch.device(device) if device is not None else model_device(model)
    if transport == "auto":
        transport = "cuda_ipc" if device.type == "cuda" else "mmap"
    if transport == "mmap":
        from asyncgrpo.weights.mmap_file import MmapPublisher

        return MmapPublisher(run, model)
    if transport == "cuda_ipc":
        from asyncgrpo.weights.cuda_ipc import CudaIpcPublisher

        return CudaIpcPublisher(run, model, device)
    if transport == "safetensors":
        from asyncgrpo.weights.snapshot import SnapshotPublisher

        return SnapshotPublisher(run, model, getattr(torch, dtype) if dtype else None)
    raise ValueError(f"unknown weights transport {transport!r} (auto, mmap, cuda_ipc, safetensors)")


def make_subscriber(run: RunDir, on_read=None, on_bad_delta=None) -> WeightSubscriber:
    """The transport and layout come from the version file, re-read when the PS restarts.
    ``on_read((publisher_id, version))`` before reading a safetensors snapshot, ``on_read(None)``
    after (a worker records it in its heartbeat: ``WorkerPresence.announce_read``);
    ``on_bad_delta((publisher_id, version))`` after each read, while the reader waits for an anchor past a delta bad
    on disk, ``on_bad_delta(None)`` otherwise (``WorkerPresence.announce_bad_delta``)."""
    from asyncgrpo.weights.subscriber import Subscriber

    return Subscriber(run, on_read, on_bad_delta)


__all__ = ["VERSION_FILE", "Layout", "Subscriber", "TransportUnavailable", "WeightPublisher", "WeightsMismatch",
           "WeightsOutOfReach", "WeightSubscriber", "make_publisher", "make_subscriber", "read_version_file"]
