"""Where each tensor of a state_dict lives in a flat publish buffer (a "slot").

Tensors are grouped per dtype (one contiguous region each, in order of first use) and
aligned to ALIGN bytes, so one uint8 buffer holds them all and every tensor is a typed
view into it. Tied tensors (the same memory under two names, e.g. embed_tokens and
lm_head) are stored once; the layout records the other names as aliases. The layout is
JSON (``layout-{publisher_id}.json``), never a pickle.

For a PEFT (LoRA) model only the adapter is laid out, and ``base`` holds the fingerprint of
the frozen base model the adapter belongs to (asyncgrpo/weights/adapter.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from asyncgrpo.run.rundir import RunDir

ALIGN = 256  # byte alignment of every tensor in a slot: any dtype view, vectorised copies


def layout_path(run: RunDir, publisher_id: str):
    return run.weights / f"layout-{publisher_id}.json"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weights layout")
    return dtype


class WeightsMismatch(ValueError):
    """The worker's model cannot take the published weights (another architecture, another base model, an
    adapter on one side only); the message is one line for the operator."""


class WeightsOutOfReach(RuntimeError):
    """The PS publishes through a transport this host cannot read (another host's shared memory or GPU): the worker
    would wait for weights for the whole run; the message is one line for the operator."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of a slot
    nbytes: int


@dataclass
class Layout:
    """Where each state_dict tensor lives in a slot. Tied tensors (same memory) are stored
    once, under their first name; ``aliases`` maps every other name to that one. ``base``:
    the base model's fingerprint when the tensors are a PEFT adapter, else None."""

    entries: list[Entry]
    aliases: dict[str, str]
    total_bytes: int
    base: dict | None = None

    @classmethod
    def of(cls, state_dict: dict, base: dict | None = None) -> Layout:
        kept: list[tuple[str, torch.Tensor]] = []
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                continue  # e.g. a module's _extra_state
            mem = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else None
            if mem is not None and mem in seen:
                aliases[name] = seen[mem]
                continue
            if mem is not None:
                seen[mem] = name
            kept.append((name, t))
        entries, offset = [], 0
        for dtype in dict.fromkeys(t.dtype for _, t in kept):  # dtypes in order of first use
            for name, t in kept:
                if t.dtype == dtype:
                    offset = _align(offset)
                    nbytes = t.numel() * t.element_size()
                    entries.append(Entry(name, dtype, tuple(t.shape), offset, nbytes))
                    offset += nbytes
        return cls(entries, aliases, max(_align(offset), ALIGN), base)  # >0: empty buffers can't be shared

    def to_json(self) -> dict:
        groups: dict[str, dict] = {}
        for e in self.entries:
            g = groups.setdefault(str(e.dtype).removeprefix("torch."), {"offset": e.offset, "end": 0})
            g["end"] = e.offset + e.nbytes
        return {"total_bytes": self.total_bytes, "aliases": self.aliases, "base": self.base,
                "groups": [{"dtype": d, "offset": g["offset"], "nbytes": g["end"] - g["offset"]}
                           for d, g in groups.items()],
                "tensors": [{"name": e.name, "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape),
                             "offset": e.offset, "nbytes": e.nbytes} for e in self.entries]}

    @classmethod
    def from_json(cls, obj: dict) -> Layout:
        total = int(obj["total_bytes"])
        entries = []
        for t in obj["tensors"]:
            e = Entry(str(t["name"]), _dtype(t["dtype"]), tuple(int(s) for s in t["shape"]),
                      int(t["offset"]), int(t["nbytes"]))
            numel = 1
            for s in e.shape:
                numel *= s
            if (e.offset % ALIGN or e.offset < 0 or e.offset + e.nbytes > total
                    or e.nbytes != numel * e.dtype.itemsize):
                raise ValueError(f"bad layout entry for {e.name}")
            entries.append(e)
        base = obj.get("base")
        if base is not None and not (isinstance(base, dict) and isinstance(base.get("sha256"), str)):
            raise ValueError("bad base fingerprint in a weights layout")
        return cls(entries, {str(k): str(v) for k, v in obj.get("aliases", {}).items()}, total, base)

    @classmethod
    def load(cls, run: RunDir, publisher_id: str) -> Layout:
        # Not fileops.read_json: that reads at most 64 KiB, and a layout can be bigger.
        return cls.from_json(json.loads(layout_path(run, publisher_id).read_bytes()))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One typed, shaped view per entry into a flat uint8 slot (made once, reused)."""
        return [flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries]

    def sources(self, state_dict: dict) -> list[torch.Tensor]:
        """The PS model's tensors in entry order; the model must not have changed shape."""
        out = []
        for e in self.entries:
            t = state_dict.get(e.name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise ValueError(f"[weights] {e.name} changed since the publisher was made; make a new one")
            out.append(t)
        return out

    def destinations(self, state_dict: dict) -> tuple[list[torch.Tensor], list[int]]:
        """The worker model's tensors to copy into, and the entry each one comes from.
        Raises WeightsMismatch when the worker's model is not the PS's (names or shapes)."""
        tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
        index = {e.name: i for i, e in enumerate(self.entries)}
        dsts, idx, problems = [], [], []
        for name, t in tensors.items():
            i = index.get(name, index.get(self.aliases.get(name, "")))
            if i is None:
                problems.append(f"{name} is not published")
            elif tuple(t.shape) != self.entries[i].shape:
                problems.append(f"{name}: shape {tuple(t.shape)} != published {self.entries[i].shape}")
            elif name in self.aliases and _same_memory(t, tensors.get(self.aliases[name])):
                continue  # tied here too: copying the kept name fills it
            else:
                dsts.append(t)
                idx.append(i)
        problems += [f"{e.name} is missing in the worker's model" for e in self.entries if e.name not in tensors]
        if problems:
            raise WeightsMismatch("the worker's model does not match the published one: "
                             + "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
        return dsts, idx


def _same_memory(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
