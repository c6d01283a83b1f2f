"""Telling "this operation failed" from "this process's GPU context is broken".

After an illegal memory access, a device-side assert, a launch failure and the like, CUDA
refuses every later call in the process: each job would fail the same way, and so would
each weight sync. Only a new process gets a new context. Out-of-memory is the exception
that matters: it concerns one allocation, the context stays usable, the next (smaller)
job may well succeed.

``is_broken_device_error`` (the worker's jobs) counts a CUDA error that is not sticky (an
invalid argument, say) as broken too: a restart costs seconds, and the job in hand is
retried by recovery up to the queue's attempt limit, so a job that always triggers it ends
up archived, not looping. ``is_sticky_cuda_error`` (a failed weight copy) is the narrow
test: a copy from the PS's memory may fail for reasons of the PS's (peer access, a dead
PS), and a worker restarted for those would fail the same way again.
"""

from __future__ import annotations

import torch

# Messages of CUDA failures as PyTorch words them when it raises a plain RuntimeError
# (before torch.AcceleratorError existed, and from libraries that still do).
_CUDA_FAILURE_MARKERS = (
    "CUDA error", "CUDA driver error", "device-side assert", "illegal memory access", "unspecified launch failure",
    "CUBLAS_STATUS_EXECUTION_FAILED", "CUBLAS_STATUS_INTERNAL_ERROR", "CUDNN_STATUS_EXECUTION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR",
)


# Errors after which the CUDA context refuses all further work (cudaError "sticky" errors)
# or the GPU is gone.
_STICKY_MARKERS = (
    "illegal memory access", "illegal address", "device-side assert", "unspecified launch failure",
    "misaligned address", "illegal instruction", "invalid program counter", "hardware stack error",
    "ECC error", "launch timed out", "GPU is lost", "CUDA error: unknown error",
)


def _cuda_error_types() -> tuple[type, ...]:
    types = [getattr(torch, "AcceleratorError", None), getattr(torch.cuda, "CudaError", None)]
    return tuple(t for t in types if isinstance(t, type))


def is_broken_device_error(err: BaseException) -> bool:
    """True when ``err`` (or an exception it was raised ``from``) says the process's CUDA
    context can no longer be trusted; False for out-of-memory and non-CUDA errors."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in text.lower()
        if not oom and (isinstance(err, _cuda_error_types())
                        or (isinstance(err, RuntimeError) and any(m in text for m in _CUDA_FAILURE_MARKERS))):
            return True
        err = err.__cause__  # explicit chaining only: a wrapper that says where it happened
    return False


def is_sticky_cuda_error(err: BaseException) -> bool:
    """True for the CUDA failures that leave the context unusable (see _STICKY_MARKERS)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if any(m in str(err) for m in _STICKY_MARKERS):
            return True
        err = err.__cause__
    return False
