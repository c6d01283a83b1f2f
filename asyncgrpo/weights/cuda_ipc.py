"""GPU transport: two flat buffers on the PS's GPU, shared once through CUDA IPC handles.

The PS allocates its two slots (one uint8 buffer each, tensors grouped by dtype inside)
and exports their IPC handles ONCE, with ``UntypedStorage._share_cuda_()``; the handle
fields go into the version file as plain JSON (bytes as hex), never as a pickle. A worker
rebuilds each buffer once per PS run with ``torch.multiprocessing.reductions.
rebuild_cuda_tensor`` (which calls ``UntypedStorage._new_shared_cuda``), then every sync
is one batched device-to-device copy into its own model. Publish and sync both wait for
their copy to finish (synchronize) before they unlock: the other side reads or overwrites
the slot right after.

Traps this module steers around (docs/design.md, "Weight transports"):
* One buffer per slot, not one handle per tensor: opening hundreds of handles costs seconds.
* The PS keeps both buffers alive until close(); close() marks the version file closed
  under both exclusive locks before freeing them, so no worker reads freed memory (a
  slot a stopped reader still holds is never freed, see base.py).
* ``expandable_segments:True`` memory cannot be shared with cudaIpc handles: the buffers
  are allocated with expandable segments switched off for the allocation only.
  The ``cudaMallocAsync`` allocator backend cannot export handles at all: refused up front.
* A handle's device index is the PS's: the worker finds the GPU by UUID, because
  CUDA_VISIBLE_DEVICES (and so the numbering) may differ between processes. The worker
  must see the PS's GPU; it then copies peer-to-peer into its own GPU if that is another.
* A dead PS's handles are invalid: a worker checks that the PS pid is alive before each
  sync and on any failure keeps its weights (sync returns None) until a new publisher_id.
  A copy that fails because this process's own CUDA context is broken is re-raised as it
  is (device_errors.py): the worker exits and is restarted, instead of keeping stale
  weights and failing every job.
* A process cannot open its own IPC handles: a subscriber in the PS's own process (tests,
  a one-process run) uses the PS's buffers directly.
"""

from __future__ import annotations

import contextlib
import os

import torch

from asyncgrpo.messages import first_line
from asyncgrpo.run.hosts import same_host
from asyncgrpo.run.liveness import pid_alive
from asyncgrpo.run.rundir import RunDir
from asyncgrpo.weights.adapter import shared_tensors
from asyncgrpo.weights.base import NUM_SLOTS, Layout, SlotPublisher, TransportUnavailable, log
from asyncgrpo.weights.device_errors import is_sticky_cuda_error

_LOCAL: dict[str, list[torch.Tensor]] = {}  # publisher_id -> slots, for subscribers in the PS's process
# Slots a closed publisher could not lock (a stopped reader held them): never freed, so the
# allocator cannot hand their memory to anything else before that reader copies from it.
_KEPT_FOR_STOPPED_READERS: list[torch.Tensor] = []


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_index(uuid: str) -> int | None:
    """This process's index of the GPU with that UUID (None: not visible here)."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


def _expandable_conf() -> bool:
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _in_expandable_segment(buf: torch.Tensor) -> bool:
    ptr = buf.data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return bool(seg.get("is_expandable", False))
    return False


@contextlib.contextmanager
def _ipc_capable_allocations():
    """New segments for these allocations are plain cudaMalloc ones (cached free blocks
    of expandable segments could still be reused: checked after allocating)."""
    if not _expandable_conf():
        yield
        return
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def _export(buf: torch.Tensor) -> dict:
    (device, handle, size_bytes, offset_bytes, ref_counter, ref_counter_offset,
     event_handle, event_sync_required) = buf.untyped_storage()._share_cuda_()
    return {"device_index": int(device), "handle": handle.hex(), "storage_size_bytes": int(size_bytes),
            "storage_offset_bytes": int(offset_bytes), "ref_counter_handle": ref_counter.hex(),
            "ref_counter_offset": int(ref_counter_offset), "event_handle": event_handle.hex(),
            "event_sync_required": bool(event_sync_required), "numel": buf.numel()}


def _open(fields: dict, device_index: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    numel, size_bytes = int(fields["numel"]), int(fields["storage_size_bytes"])
    if not 0 < numel <= size_bytes:
        raise ValueError("bad buffer size in the version file")
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([numel]), (1,), 0, torch.storage.TypedStorage, torch.uint8, device_index,
        bytes.fromhex(fields["handle"]), size_bytes, int(fields["storage_offset_bytes"]), False,
        bytes.fromhex(fields["ref_counter_handle"]), int(fields["ref_counter_offset"]),
        bytes.fromhex(fields["event_handle"]), bool(fields["event_sync_required"]))


def _synchronize(devices) -> None:
    for d in devices:
        torch.cuda.synchronize(d)


def model_device(model: torch.nn.Module) -> torch.device:
    for t in model.state_dict().values():
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


class CudaIpcPublisher(SlotPublisher):
    transport = "cuda_ipc"

    def __init__(self, run: RunDir, model: torch.nn.Module, device: torch.device | str | None = None):
        device = torch.device(device) if device is not None else model_device(model)
        if device.type != "cuda":
            raise ValueError(f"cuda_ipc needs the buffers on a GPU, not {device}")
        if torch.cuda.memory.get_allocator_backend() != "native":
            raise RuntimeError("cuda_ipc needs PyTorch's native CUDA allocator (cudaMallocAsync cannot share "
                               "IPC handles); unset backend:cudaMallocAsync or use transport='mmap'")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        super().__init__(run, model)
        with torch.cuda.device(self.device), _ipc_capable_allocations():
            slots = [torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
                     for _ in range(NUM_SLOTS)]
        torch.cuda.synchronize(self.device)
        if _expandable_conf() and any(_in_expandable_segment(s) for s in slots):
            raise RuntimeError("the cuda_ipc buffers landed in expandable segments, which cannot be shared "
                               "through cudaIpc handles: start the PS without expandable_segments:True")
        self._set_slots(slots)
        self._handles = [_export(s) for s in slots]  # once, for the life of this PS run
        self._uuid = device_uuid(self.device.index)
        self._devices = {self.device} | {t.device for t in self.layout.sources(shared_tensors(model)) if t.is_cuda}
        _LOCAL[self.publisher_id] = slots
        log.info("[weights] cuda_ipc publisher %s: %d tensors, 2 x %.1f MB on %s (%s)", self.publisher_id[:8],
                 len(self.layout.entries), self.layout.total_bytes / 1e6, self.device, self._uuid)

    def _copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        with torch.cuda.device(self.device):
            torch._foreach_copy_(dsts, srcs)
        _synchronize(self._devices)  # the version file must never name a slot whose copy is in flight

    def _fields(self) -> dict:
        return {"device_uuid": self._uuid, "ipc": self._handles}

    def _release(self, held: set[int]) -> None:
        _LOCAL.pop(self.publisher_id, None)
        _KEPT_FOR_STOPPED_READERS.extend(self.slots[i] for i in sorted(held))
        # Each export counts one expected consumer; ours are many and the closed version
        # file already keeps them out, so drop that count: the memory is then freed at
        # once instead of waiting in PyTorch's IPC limbo (and warning at exit).
        for i, h in enumerate(self._handles):
            if i in held:
                continue
            with contextlib.suppress(Exception):
                torch.UntypedStorage._release_ipc_counter_cuda(bytes.fromhex(h["ref_counter_handle"]),
                                                               h["ref_counter_offset"])
        self._set_slots([])


class CudaIpcReader:
    uses_slots = True

    def __init__(self, run: RunDir, info: dict, layout: Layout):
        self.layout = layout
        self.read_bytes = layout.total_bytes  # every sync copies the whole slot
        if not same_host(info):
            raise TransportUnavailable(f"the PS runs on {info.get('host')}: CUDA IPC works within one host "
                                       "(publish with transport='safetensors' for other hosts)")
        if not pid_alive(info.get("pid"), info.get("host"), info.get("host_id")):
            raise TransportUnavailable(f"the PS (pid {info.get('pid')}) is gone")  # its handles are invalid
        if not torch.cuda.is_available():
            raise TransportUnavailable("CUDA is not available in this process")
        index = local_device_index(str(info.get("device_uuid")))
        if index is None:
            raise TransportUnavailable(f"the PS's GPU {info.get('device_uuid')} is not visible here "
                                       "(CUDA_VISIBLE_DEVICES must include it)")
        self.device = torch.device("cuda", index)
        handles = info.get("ipc")
        if not isinstance(handles, list) or len(handles) != NUM_SLOTS:
            raise ValueError("no IPC handles in the version file")
        if info.get("pid") == os.getpid() and info["publisher_id"] in _LOCAL:
            slots = _LOCAL[info["publisher_id"]]
        else:
            try:
                slots = [_open(h, index) for h in handles]
            except RuntimeError as err:  # a dead PS's handles, no peer access, ...
                raise TransportUnavailable(f"cannot open the IPC handles: {first_line(err)}") from err
        if any(s.numel() < layout.total_bytes for s in slots):
            raise ValueError("IPC buffers are smaller than the layout")
        self.views = [layout.views(s) for s in slots]

    def usable(self, info: dict) -> bool:
        return pid_alive(info.get("pid"), info.get("host"), info.get("host_id"))

    def copy_out(self, info: dict, dsts: list[torch.Tensor], idx: list[int]) -> None:
        views = self.views[info["buffer"]]
        devices = {self.device} | {d.device for d in dsts if d.is_cuda}
        try:
            with torch.cuda.device(self.device):
                torch._foreach_copy_(dsts, [views[i] for i in idx])
            _synchronize(devices)  # before the caller unlocks: the PS may overwrite this slot next
        except RuntimeError as err:
            if is_sticky_cuda_error(err):
                raise  # this process's CUDA context is gone: the worker must exit, not keep syncing
            raise TransportUnavailable(f"copy failed: {first_line(err)}") from err

    def close(self) -> None:
        self.views = []
