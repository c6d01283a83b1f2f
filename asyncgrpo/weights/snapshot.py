"""Workers on other hosts: the weights as files on the shared filesystem, a full anchor every ANCHOR_EVERY
versions and, between anchors, each version as what changed since the one before (deltas.py).

``RUN/weights/snapshots/v{version:08d}.safetensors`` is an anchor (every tensor: a state dict by its names),
``d{version:08d}.safetensors`` a delta against the version before it: per tensor, the positions whose bits
changed and their values (or the tensor whole where most changed), and the checksum of each tensor it changes.
The PS keeps the last published version to compare against, and writes an anchor at its first publish, every
ANCHOR_EVERY versions, whenever a delta's file would not be smaller, and whenever the deltas after the anchor would
weigh more than twice it (a reader catching up reads them all). Each file is written to a dot-temp name and
renamed into place, then the version file names it and the chain of versions from the newest anchor to it: a
reader that sees a version sees complete, never-again-modified files, so no locks are needed (and none would
be trustworthy across NFS clients). Each file carries its publisher_id, version and base version in the
safetensors metadata, and the reader checks them, so a restarted PS that reuses a version number is never
mistaken for the old one.

A reader holding a version of the chain applies the deltas after it in place; any other reader (a new one, one
that fell behind the newest anchor, one holding another publisher's weights) reads the anchor and the deltas
after it. Before it writes a file's tensors it checks each one's checksum (deltas.py): a file corrupted on
disk, or weights that are not the version the delta starts from, are caught with nothing written. Then it
reads the anchor again; a delta that still does not check out against it is bad on disk, and the reader keeps
the version it reached until a newer anchor is published.

Deleting old files. A worker records in its heartbeat the chain it is about to read (its anchor's version,
``WorkerPresence.announce_read``, written before it opens a file); after each publish the PS deletes the files of
every chain but the newest, except the newest KEEP files and the chains live workers' heartbeats name (alive as
liveness.py judges it, with a lease of READER_LEASE_S). So a live worker's read is
never cut short, on any host. The one window left: a worker that names a chain just after the PS looked. Its
file may then vanish under it, which is why a reader never maps a file (a mapped page of a file deleted on an
NFS server is a SIGBUS): it reads the whole file with plain reads, which either return the file's bytes or fail
(ENOENT, ESTALE), and on failure the reader keeps what it has applied, reads the version file again and goes on
from there.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import math
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
from asyncgrpo.weights import deltas
from asyncgrpo.weights.adapter import layout_of, shared_tensors
from asyncgrpo.weights.base import (
    Layout,
    TransportUnavailable,
    layout_path,
    log,
    remove_other_layouts,
    version_path,
)
from asyncgrpo.weights.layout import WeightsMismatch
from asyncgrpo.weights.memcopy import put, spread

ANCHOR_EVERY = 20  # versions per chain: a reader that fell behind reads an anchor and at most this many deltas
KEEP = 2  # the newest files are kept whatever else: a reader that read the version file just before a publish
# A reader on another host protects its chain while its heartbeat is younger than this. Only disk space hangs
# on it: a reader that loses a file re-reads the version file.
READER_LEASE_S = DEFAULT_LEASE_S


def snapshot_dir(run: RunDir):
    return run.weights / "snapshots"


def snapshot_path(run: RunDir, version: int, anchor: bool = True):
    return snapshot_dir(run) / f"{'v' if anchor else 'd'}{version:08d}.safetensors"


def versions_being_read(run: RunDir, publisher_id: str) -> set[int]:
    """The anchors of the chains of ``publisher_id`` that live workers' heartbeats say they are reading."""
    return {w.reading[1] for w in list_workers(run, fs_now(run), READER_LEASE_S)
            if w.reading is not None and w.reading[0] == publisher_id}


class SnapshotPublisher:
    transport = "safetensors"

    def __init__(self, run: RunDir, model: torch.nn.Module, dtype: torch.dtype | None = None):
        """``dtype``: the dtype the files hold (the workers'), when it is not the model's."""
        self.run, self.model, self.host, self.dtype = run, model, socket.gethostname(), dtype
        self.publisher_id = uuid.uuid4().hex
        self.layout = layout_of(model)  # the whole model, or a PEFT model's adapter only (adapter.py)
        self.published_bytes = 0  # the size of the last version's file
        self._version: int | None = None
        self._step = 0
        self._previous: list[torch.Tensor] | None = None  # the last published version, in the files' dtype
        self._checksums: list[int] = []
        self._chain: list[int] = []  # versions from the newest anchor to the last published one
        self._anchor_bytes = 0  # the newest anchor's file size, and the deltas' after it
        self._chain_bytes = 0
        self._written: collections.deque = collections.deque()  # (version, path, its chain's anchor), oldest first
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
        t0 = time.perf_counter()
        with torch.no_grad():
            sources = self.layout.sources(shared_tensors(self.model) if tensors is None else tensors)
            new = [t.detach().to(self.dtype if self.dtype and t.is_floating_point() else t.dtype).contiguous()
                   for t in sources]
            first = self._previous is None
            anchor = first or len(self._chain) >= ANCHOR_EVERY  # (else: unless the delta is no smaller)
            changes = [(None, None, deltas.checksum(t)) for t in new] if anchor else [
                self._change(i, t) for i, t in enumerate(new)]
            parts = {}
            for e, t, (delta, _, _) in zip(self.layout.entries, new, changes, strict=True):
                if delta is None and not anchor:
                    parts[f"all:{e.name}"] = t.cpu()
                elif delta:
                    parts.update({f"{kind}:{e.name}": part.cpu() for kind, part in delta.items()})
            anchor = anchor or deltas.nbytes(parts) >= sum(t.numel() * t.element_size() for t in new)
            size = None
            if not anchor:  # (a file no smaller than the anchor, or a chain a reader catching up would read more than
                # twice the model in: an anchor instead; the file's header and checksums weigh too)
                most = min(self._anchor_bytes - 1, 2 * self._anchor_bytes - self._chain_bytes)
                path = snapshot_path(self.run, version, anchor=False)
                size = self._write(path, parts, self._metadata(version, changes, anchor=False), most)
            anchor = size is None
            if anchor:
                path = snapshot_path(self.run, version, anchor=True)
                parts = {e.name: t.cpu() for e, t in zip(self.layout.entries, new, strict=True)}  # a state dict
                size = self._anchor_bytes = self._write(path, parts, self._metadata(version, changes, anchor=True))
                self._chain_bytes = 0
            else:
                self._chain_bytes += size
            self.published_bytes = size
            # Published: what the next delta is against.
            if first:
                self._previous = [t.clone() for t in new]
            else:
                for previous, t, (delta, written, _) in zip(self._previous, new, changes, strict=True):
                    if delta is None:
                        previous.copy_(t)
                    elif written is not None:
                        put(deltas.flat_bits(previous), *written)
            self._checksums = [checksum for _, _, checksum in changes]
            self._chain = [version] if anchor else [*self._chain, version]
        self._version, self._step = version, step
        self._name(path)
        log.debug("[weights] published v%d step %d %s %d bytes write_ms=%.1f", version, step,
                  "anchor" if anchor else "delta", self.published_bytes, (time.perf_counter() - t0) * 1e3)
        return True

    def while_trainer_waits(self, waited_long: bool) -> None:
        """Called every few seconds while the PS waits for results: workers behind a delta bad on disk wait for an
        anchor that the PS, waiting for them, would not publish. The last version goes out again as one at once
        where a live worker's heartbeat names such a delta of the newest chain, and after a long wait in any case
        (a worker may not have said so yet)."""
        if self._previous is None or len(self._chain) <= 1:
            return
        if not waited_long:
            asked = [w for w in list_workers(self.run, fs_now(self.run), READER_LEASE_S) if w.bad_delta
                     and w.bad_delta[0] == self.publisher_id and w.bad_delta[1] in self._chain]
            if not asked:
                return
            log.warning("[weights] worker %s found v%d's delta bad on disk: the parameter server publishes v%d again "
                        "as an anchor", asked[0].device, asked[0].bad_delta[1], self._version)
        self.anchor_now()

    def anchor_now(self) -> None:
        """The last version again, as an anchor, when it was a delta (``while_trainer_waits``)."""
        if self._previous is None or len(self._chain) <= 1:
            return
        path = snapshot_path(self.run, self._version, anchor=True)
        parts = {e.name: t.cpu() for e, t in zip(self.layout.entries, self._previous, strict=True)}
        checksums = {e.name: f"{checksum:08x}" for e, checksum in zip(self.layout.entries, self._checksums,
                                                                     strict=True)}
        self.published_bytes = self._anchor_bytes = self._write(path, parts, {
            "publisher_id": self.publisher_id, "version": str(self._version), "base": "",
            "checksums": json.dumps(checksums)})
        self._chain, self._chain_bytes = [self._version], 0
        self._name(path)
        log.info("[weights] v%d published again as an anchor (the parameter server waits for results: a worker "
                 "behind a bad delta reads it)", self._version)

    def _name(self, path) -> None:
        """The version file names the newest file and its chain; older chains' files go."""
        fileops.write_json(version_path(self.run), {
            "version": self._version, "step": self._step, "transport": self.transport,
            "publisher_id": self.publisher_id, "pid": os.getpid(), "host": self.host, "host_id": HOST_ID,
            "written_at": time.time(), "buffer": None, "closed": False,
            "layout_file": layout_path(self.run, self.publisher_id).name, "path": str(path), "chain": self._chain,
            "file_bytes": self.published_bytes, "total_bytes": self.layout.total_bytes,
            "num_tensors": len(self.layout.entries)})
        self._written.append((self._version, path, self._chain[0]))
        self._prune()

    def _change(self, i: int, t: torch.Tensor) -> tuple[dict | None, tuple | None, int]:
        """Tensor ``i`` against the last version: its delta's parts (empty: unchanged; None: it goes whole), the
        positions and bits they write, and the new checksum."""
        previous, bits = deltas.flat_bits(self._previous[i]), deltas.flat_bits(t)
        differs = previous != bits
        changed = int(torch.count_nonzero(differs))
        if changed == 0:
            return {}, None, self._checksums[i]
        if deltas.mostly_changed(t.numel(), changed):
            return None, None, deltas.checksum(t)
        parts, positions, values, checksum = deltas.encode(previous, bits, differs.nonzero().reshape(-1),
                                                           self._checksums[i])
        if deltas.nbytes(parts) >= t.numel() * t.element_size():
            return None, None, deltas.checksum(t)
        return parts, (positions, values), checksum

    def _metadata(self, version: int, changes: list, anchor: bool) -> dict[str, str]:
        touched = {e.name: f"{checksum:08x}" for e, (delta, _, checksum) in zip(
            self.layout.entries, changes, strict=True) if anchor or delta is None or delta}
        return {"publisher_id": self.publisher_id, "version": str(version),
                "base": "" if anchor else str(self._version), "checksums": json.dumps(touched)}

    def _write(self, path, parts: dict[str, torch.Tensor], metadata: dict[str, str], most: float = math.inf
               ) -> int | None:
        """``parts`` as a safetensors file at ``path``; its size, or None and nothing written where it would weigh more
        than ``most`` bytes."""
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            try:
                save_file(parts, str(tmp), metadata=metadata)
            except SafetensorError as err:  # "I/O error: No space left on device (os error 28)": say so, and where
                found = re.search(r"\(os error (\d+)\)", str(err))
                if found is None:
                    raise
                raise OSError(int(found.group(1)), os.strerror(int(found.group(1))), str(path)) from err
            size = os.path.getsize(tmp)
            if size > most:
                os.unlink(tmp)
                return None
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return size

    def _prune(self) -> None:
        """Deletes the files of chains before the newest anchor's, but the newest KEEP files and the chains live
        workers are reading."""
        being_read = versions_being_read(self.run, self.publisher_id)
        newest = list(self._written)[-KEEP:]
        kept = collections.deque()
        for written in self._written:
            version, path, anchor = written
            if anchor == self._chain[0] or anchor in being_read or written in newest:
                kept.append(written)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._written = kept

    def close(self) -> None:
        """Nothing to free: the last files stay loadable (workers elsewhere may still want them)."""


class BadDelta(Exception):
    """A file whose tensors do not check out against the weights it is applied to, or cannot be read."""

    def __init__(self, version: int, message: str):
        super().__init__(message)
        self.version = version


class SnapshotReader:
    uses_slots = False

    def __init__(self, run: RunDir, info: dict, layout: Layout):
        self.run, self.layout = run, layout
        self.publisher_id = info["publisher_id"]
        self._held: int | None = None  # the version in the destination tensors, applied by this reader
        self._held_in: tuple | None = None  # which destination tensors
        self._checksums: dict[str, int] = {}  # of the version held, by entry name
        self._dtypes: dict[str, torch.dtype] = {}  # the files' dtype of each entry (the anchor's)
        self._bad: int | None = None  # a delta that did not check out against a fresh anchor
        self.waiting_past: int | None = None  # that delta, while the last copy_out kept a version before it
        self.read_bytes = 0  # the files the last copy_out read

    def usable(self, info: dict) -> bool:
        return True

    def first_version(self, info: dict) -> int:
        """The earliest version whose file a read of ``info`` may open (what a worker announces)."""
        return _chain(info)[0]

    def copy_out(self, info: dict, dsts: list[torch.Tensor], idx: list[int]) -> int:
        """Brings the destination tensors to ``info``'s version, or as near as the files allow; the version they
        hold. FileNotFoundError: a file was deleted before anything was applied (a newer chain is named now)."""
        chain, self.read_bytes, self.waiting_past = _chain(info), 0, None
        if self._bad is not None and self._bad in chain and self._held is not None:
            self.waiting_past = self._bad
            return self._held  # waiting for an anchor past the bad delta
        failed = None
        if self._held_in == _identity(dsts) and self._held in chain:
            try:
                return self._apply_chain(chain, chain.index(self._held) + 1, dsts, idx)
            except BadDelta as err:
                failed = err
        try:
            reached = self._apply_chain(chain, 0, dsts, idx)
        except BadDelta as err:
            self._bad = err.version
            if self._held is None:
                raise TransportUnavailable(str(err)) from err
            log.warning("[weights] %s%s: keeping v%d until the parameter server publishes a newer anchor", err,
                        "" if failed is None else f", also after reading the anchor v{chain[0]}", self._held)
            self.waiting_past = self._bad
            return self._held
        if failed is not None:
            log.warning("[weights] %s: read the anchor v%d and the deltas after it instead (now v%d)", failed,
                        chain[0], reached)
        return reached

    def _apply_chain(self, chain: list[int], start: int, dsts: list[torch.Tensor], idx: list[int]) -> int:
        for position in range(start, len(chain)):
            version = chain[position]
            try:
                tensors, meta, checksums = self._read(version, anchor=position == 0)
                if meta.get("base", "") != ("" if position == 0 else str(chain[position - 1])):
                    raise TransportUnavailable(f"v{version}'s file follows v{meta.get('base')}, not the chain's")
            except (FileNotFoundError, TransportUnavailable):
                if position == start:
                    raise
                return self._held  # what it applied stays, and is the version said: the next sync goes on from there
            self._apply(version, tensors, checksums, dsts, idx, anchor=position == 0)
        return self._held

    def _read(self, version: int, anchor: bool) -> tuple[dict[str, torch.Tensor], dict, dict]:
        """A file's tensors, metadata and checksums."""
        path = snapshot_path(self.run, version, anchor)  # derived, never a path read from the file
        try:
            with open(path, "rb") as f:  # plain reads, never a mapping (module docstring)
                data = f.read()
            self.read_bytes += len(data)
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ESTALE):
                raise FileNotFoundError(f"{path} was deleted (a newer snapshot is named now)") from err
            raise TransportUnavailable(f"{path}: {err}") from err
        try:
            meta = _metadata(data)
            if meta.get("publisher_id") != self.publisher_id or meta.get("version") != str(version):
                raise FileNotFoundError(f"{path} belongs to another publisher or version")
            checksums = json.loads(meta.get("checksums", "{}"))
            if not isinstance(checksums, dict):
                raise ValueError("checksums is not a JSON object")
            return load(data), meta, checksums
        except (SafetensorError, ValueError, KeyError, RuntimeError) as err:
            raise BadDelta(version, f"v{version}'s file {path.name} cannot be read ({err})") from err

    def _apply(self, version: int, tensors: dict, checksums: dict, dsts: list[torch.Tensor], idx: list[int],
               anchor: bool) -> None:
        """Checks every tensor of the file against its checksum, then writes them (nothing written if one fails).
        On a CPU, the deltas of the tensors are decoded and written spread over two threads: most tensors change in
        fewer elements than torch runs an op over threads for (``memcopy.spread``)."""
        by_entry: dict[int, list[torch.Tensor]] = {}
        for dst, i in zip(dsts, idx, strict=True):
            by_entry.setdefault(i, []).append(dst)
        writes, changed, sums, dtypes = [], [], {}, {}
        threads = 2 if all(t.device.type == "cpu" for t in dsts) else 1
        try:
            for i, targets in by_entry.items():
                name = self.layout.entries[i].name
                if name not in checksums:
                    if anchor:
                        raise KeyError(name)
                    continue
                expected = int(checksums[name], 16)
                whole = tensors.get(name if anchor else f"all:{name}")
                if whole is not None:
                    if tuple(whole.shape) != self.layout.entries[i].shape or deltas.checksum(whole) != expected:
                        raise BadDelta(version, f"v{version}'s {name} does not match its checksum")
                    writes.append((targets, None, whole))
                    dtypes[name] = whole.dtype
                else:
                    changed.append((version, name, tensors, targets, expected))
                sums[name] = expected
            writes += spread(self._decoded, changed, most=threads)
        except WeightsMismatch:
            raise
        except (KeyError, IndexError, RuntimeError, ValueError) as err:
            raise BadDelta(version, f"v{version}'s file lacks or garbles a tensor ({err})") from err
        # Whole tensors go to the device one by one, a delta's positions and values chunk by chunk (``put``): on a
        # GPU, all of them at once would weigh as much as the model at an anchor, and a sixth of it at 1e-5.
        try:
            spread(_write, writes, most=threads)
        except BaseException:
            self._held = self._held_in = None  # written in part: the next sync starts from an anchor
            raise
        self._checksums = sums if anchor else {**self._checksums, **sums}
        self._dtypes = dtypes if anchor else {**self._dtypes, **dtypes}
        self._held, self._held_in = version, _identity(dsts)

    def _decoded(self, version: int, name: str, tensors: dict, targets: list[torch.Tensor], expected: int
                 ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``targets`` and the positions and new values of ``name``'s delta, checked against its checksum and the
        bits the first target holds. A worker holding a wider dtype than the files' (their values, widened exactly) is
        read back in the files'."""
        held = targets[0]
        dtype = self._dtypes[name]
        if torch.promote_types(held.dtype, dtype) != held.dtype:
            raise WeightsMismatch(f"the worker holds {name} in {held.dtype}, narrower than the published "
                                  f"{dtype}: give the workers the parameter server's --dtype and --worker_dtype")
        parts = {kind: tensors[f"{kind}:{name}"] for kind in ("gap", "idx", "dif", "val", "was")
                 if f"{kind}:{name}" in tensors}
        positions, new_bits, before, after = deltas.decode(parts, held.reshape(-1), dtype)
        if int(parts["was"]) != before:
            raise BadDelta(version, f"the worker's {name} is not v{self._held} where v{version}'s delta writes")
        if deltas.updated(self._checksums[name], before, after) != expected:
            raise BadDelta(version, f"v{version}'s delta of {name} does not check out against v{self._held}")
        return targets, positions, new_bits.view(dtype)

    def close(self) -> None:
        pass


def _write(targets: list[torch.Tensor], positions: torch.Tensor | None, values: torch.Tensor) -> None:
    """A tensor whole (``positions`` None), or its delta's values at ``positions``, into every target."""
    with torch.no_grad():  # (a thread of ``spread`` does not share its caller's)
        for dst in targets:
            if positions is None:
                dst.copy_(values)
            else:
                put(dst.view(-1), positions, values.to(dst.dtype))


def _chain(info: dict) -> list[int]:
    chain = info.get("chain")
    ok = isinstance(chain, list) and chain and all(isinstance(v, int) for v in chain) and chain[-1] == info["version"]
    return chain if ok else [info["version"]]


def _identity(dsts: list[torch.Tensor]) -> tuple:
    return tuple((t.device, t.data_ptr()) for t in dsts)


def _metadata(data: bytes) -> dict:
    """The ``__metadata__`` of a safetensors file's header: 8 bytes of length, then JSON."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    return header.get("__metadata__") or {}
