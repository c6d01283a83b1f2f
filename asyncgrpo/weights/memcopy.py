"""Copying many tensors at memory bandwidth, and the scattered elements of a delta.

``torch._foreach_copy_`` on CPU is one ATen op per tensor, and each op over a few MB
opens an OpenMP parallel region. On a small VM (2 vCPUs, measured here) waking the
idle OpenMP threads costs milliseconds per op: copying a 0.5B model (291 tensors, 2 GB)
took 1.4 s that way against 0.3 s for one flat copy of the same bytes. So contiguous,
same-dtype CPU pairs are copied with plain memmoves instead, spread over
``torch.get_num_threads()`` threads (ctypes releases the GIL during the call; the calling
thread takes a share). Large tensors are cut into chunks so one embedding matrix doesn't
leave the other threads idle. Anything else (GPU, strided, dtype-converting) goes
through ``torch._foreach_copy_``.

A memmove does not bump autograd's version counters: fine for weights that workers
only run inference with and for the PS's read-only side.

A delta's elements (deltas.py) are spread over the whole tensor: at 1.6% changed, one in
every second cache line. Reading them is bound by memory latency, and torch's
``index_select`` reads on one thread: ``take`` spreads the positions over the threads too
(1.6% of a 272 MB bfloat16 matrix: 20 ms on one thread, 10 ms on two, on the 2-vCPU VM).
``index_copy_`` writes on torch's threads already (12 ms there, against 18 ms for an
assignment through the positions). But most of a model's tensors change in fewer elements
than torch runs an op over threads for (at 1e-6, a median of 16K positions a tensor at 0.5B),
so a reader spreads a version's tensors over two threads too (``spread``; snapshot.py).
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import torch

_CHUNK = 16 << 20
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)
_pool_lock = threading.Lock()


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        # New threads after a fork, or more of them; a pool with more than asked for takes fewer tasks as well.
        if _pool is None or _pool[0] != os.getpid() or _pool[1] < workers:
            _pool = (os.getpid(), workers, ThreadPoolExecutor(workers, thread_name_prefix="weights-copy"))
        return _pool[2]


def _memmoves(jobs: list[tuple[int, int, int]]) -> None:
    for dst, src, n in jobs:
        ctypes.memmove(dst, src, n)


def _plain(d: torch.Tensor, s: torch.Tensor) -> bool:
    return (d.device.type == "cpu" and s.device.type == "cpu" and d.dtype == s.dtype and d.shape == s.shape
            and d.is_contiguous() and s.is_contiguous())


def copy_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair."""
    jobs: list[tuple[int, int, int]] = []
    other_d, other_s = [], []
    for d, s in zip(dsts, srcs, strict=True):
        if not _plain(d, s):
            other_d.append(d)
            other_s.append(s)
            continue
        n = d.numel() * d.element_size()
        jobs += [(d.data_ptr() + o, s.data_ptr() + o, min(_CHUNK, n - o)) for o in range(0, n, _CHUNK)]
    if other_d:
        torch._foreach_copy_(other_d, other_s)
    threads = min(max(1, torch.get_num_threads()), len(jobs))
    if threads <= 1:
        _memmoves(jobs)
        return
    groups: list[list] = [[] for _ in range(threads)]
    loads = [0] * threads
    for job in sorted(jobs, key=lambda j: -j[2]):  # biggest first onto the least loaded thread
        i = loads.index(min(loads))
        groups[i].append(job)
        loads[i] += job[2]
    futures = [_executor(threads - 1).submit(_memmoves, g) for g in groups[1:]]
    _memmoves(groups[0])
    for f in futures:
        f.result()


_MIN_TAKE = 1 << 14  # positions below which one thread takes them all (a thread's hand-off costs more)


_in_share = threading.local()  # set while a thread runs a share of ``spread``


def spread(fn, items: list, most: int | None = None) -> list:
    """``[fn(*item) for item in items]``, the items spread over torch's threads (at most ``most``), the calling thread
    taking a share. Called from within a share, it runs the items itself: a share that waited for shares of its own
    could wait for itself. Returns, or raises what a share raised, once every share has ended (a share still running
    could write after its caller went on). ``fn`` runs with autograd on (``torch.no_grad`` is the caller thread's)."""
    threads = min(max(1, torch.get_num_threads()), len(items), most or len(items))
    if threads <= 1 or getattr(_in_share, "on", False):
        return [fn(*item) for item in items]

    def run(share: list[int]) -> list:
        _in_share.on = True
        try:
            return [fn(*items[i]) for i in share]
        finally:
            _in_share.on = False

    shares = [list(range(i, len(items), threads)) for i in range(threads)]
    futures = [_executor(threads - 1).submit(run, share) for share in shares[1:]]
    try:
        mine = run(shares[0])
    finally:
        wait(futures)
    results: list = [None] * len(items)
    for share, share_results in zip(shares, [mine, *(f.result() for f in futures)], strict=True):
        for i, result in zip(share, share_results, strict=True):
            results[i] = result
    return results


def take(flat: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``flat[positions]`` of a 1-D tensor and int64 positions."""
    flat = flat.detach()  # (the pool's threads run with autograd on)
    threads = min(max(1, torch.get_num_threads()), positions.numel() // _MIN_TAKE)
    if flat.device.type != "cpu" or threads <= 1:
        return torch.index_select(flat, 0, positions)
    out = torch.empty(positions.numel(), dtype=flat.dtype)
    spread(lambda p, o: torch.index_select(flat, 0, p, out=o),
           list(zip(positions.tensor_split(threads), out.tensor_split(threads), strict=True)))
    return out


_PUT_CHUNK = 1 << 22  # positions ``put`` writes at a time


def put(flat: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[positions] = values`` of a 1-D tensor, int64 positions (no two the same) and values of its dtype, on
    any device. Chunk by chunk: on a GPU, a whole model's positions and values at once (a learning rate of 1e-5
    changes a sixth of its elements) would weigh more than its largest tensor."""
    for start in range(0, positions.numel(), _PUT_CHUNK):
        end = start + _PUT_CHUNK
        flat.index_copy_(0, positions[start:end].to(flat.device), values[start:end].to(flat.device))
