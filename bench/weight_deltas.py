"""Weights to other hosts as deltas against full snapshots, side by side in one invocation.

A Qwen2.5-0.5B-shaped model (random initialisation, float32, tied embeddings) trains real steps: AdamW on a
GRPO-like loss (advantage-weighted log-probabilities of random completions). After each step the same
weights are published as deltas and as a full file in bfloat16 (the workers' dtype), and every few steps as a
full file in float32 (the PS's dtype):

* deltas: ``SnapshotPublisher`` (asyncgrpo/weights/snapshot.py), an anchor every ANCHOR_EVERY versions and the
  changed elements between them; a reader (``Subscriber``) applies each version in place onto a bfloat16 model;
* full: a whole bfloat16 safetensors file per version, written to a temp name and renamed, and read back the
  way a reader on another host reads one (plain reads, parsed, copied into a bfloat16 model): an anchor's size;
* before: what a version cost before deltas and ``--worker_dtype``, a whole file in the PS's dtype (float32) read
  and converted into the bfloat16 model the same way; written and read every ``--before-every`` versions (2 GB
  at 0.5B: the medians need no more).

One version (``--xor-at``) is also written the other way a delta can be: the XOR of each tensor's bits with the
version before, compressed with zlib; its bytes and time are printed beside the positions-and-values delta's.

Per version it prints the bytes each writes, the PS's publish time and the reader's read-and-apply time, and
at the end the medians and ratios per learning rate, and whether the delta reader's weights are bit-identical
to the PS's published ones after the last version. By default the readers read files the PS just wrote, so from
the page cache. With ``--cold`` each file is flushed and dropped from the page cache before it is read (untimed),
so it comes from the disk, as on a host that did not write it.

Run:  .venv/bin/python bench/weight_deltas.py [--shape 0.5b|tiny] [--lrs 1e-6,1e-5] [--versions 100,30]
        [--before-every 5] [--cold]
(temp run dirs under /tmp, removed at the end)
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import load, save_file

from asyncgrpo.run import RunDir
from asyncgrpo.weights import deltas, make_subscriber
from asyncgrpo.weights.adapter import shared_tensors
from asyncgrpo.weights.snapshot import ANCHOR_EVERY, SnapshotPublisher, snapshot_dir

SHAPES = {  # Qwen2.5-0.5B, and a small model of its widths for a quick try
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=2, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=8192),
}


def build(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape], tie_word_embeddings=True)).to(dtype)


def grpo_like_step(model, optimizer, step: int, batch: int, tokens: int) -> float:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=gen)
    advantages = torch.randn(batch, 1, generator=gen)
    logits = model(ids).logits[:, :-1].float()
    logps = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(advantages * logps).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


class FullSnapshots:
    """The whole model in ``dtype``, one file per version."""

    def __init__(self, folder: Path, model: torch.nn.Module, dtype: torch.dtype):
        self.folder, self.model, self.dtype = folder, model, dtype
        folder.mkdir()
        tensors = shared_tensors(model)
        self.names = list({t.data_ptr(): name for name, t in tensors.items()}.values())  # tied: once

    def publish(self, version: int) -> tuple[Path, int]:
        tensors = shared_tensors(self.model)
        path = self.folder / f"v{version:08d}.safetensors"
        tmp = self.folder / f".{path.name}.tmp"
        save_file({n: tensors[n].detach().to(self.dtype).contiguous() for n in self.names}, str(tmp),
                  metadata={"version": str(version)})
        os.replace(tmp, path)
        for old in self.folder.glob("v*.safetensors"):
            if old != path:
                old.unlink()
        return path, path.stat().st_size

    @staticmethod
    def read(path: Path, worker: torch.nn.Module) -> None:
        with open(path, "rb") as f:
            data = f.read()
        tensors = load(data)
        held = shared_tensors(worker)
        with torch.no_grad():
            for name, t in tensors.items():
                held[name].copy_(t)


def drop_from_cache(paths) -> None:
    """Writes the files' pages out and drops them from the page cache: the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def published_bits(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: deltas.flat_bits(t.detach().to(dtype)).clone() for n, t in shared_tensors(model).items()}


def xor_compressed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict:
    """The other way to write a version: the XOR of each tensor's bits with the version before, compressed
    (zlib, fastest level): its bytes and the time to make it."""
    t0 = time.perf_counter()
    size = sum(len(zlib.compress((after[n] ^ before[n]).numpy().tobytes(), 1)) for n in after)
    return {"bytes": size, "ms": (time.perf_counter() - t0) * 1e3}


def run_lr(shape: str, lr: float, versions: int, batch: int, tokens: int, root: Path, xor_at: int,
           before_every: int, cold: bool) -> dict:
    model, dtype = build(shape, torch.float32), torch.bfloat16
    worker_deltas, worker_full = build(shape, dtype), build(shape, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    run = RunDir.create(root / f"deltas-{lr:g}")
    publisher = SnapshotPublisher(run, model, dtype=dtype)
    subscriber = make_subscriber(run)
    full = FullSnapshots(root / f"full-{lr:g}", model, dtype)
    before_deltas = FullSnapshots(root / f"before-{lr:g}", model, torch.float32)
    before_read_ms = []
    rows, xor = [], None
    print(f"\nlr {lr:g}: version kind delta_MB full_MB ratio | publish_ms delta full | read_ms delta full")
    for version in range(1, versions + 1):
        before = published_bits(model, dtype) if version == xor_at else None
        grpo_like_step(model, optimizer, version, batch, tokens)
        if before is not None:
            xor = xor_compressed(before, published_bits(model, dtype))
        t0 = time.perf_counter()
        publisher.publish(version, version)
        publish_delta = time.perf_counter() - t0
        anchor = publisher._chain == [version]
        if cold:
            drop_from_cache(snapshot_dir(run).glob("v*.safetensors"))
        t0 = time.perf_counter()
        assert subscriber.sync(worker_deltas) == version
        read_delta = time.perf_counter() - t0
        t0 = time.perf_counter()
        path, full_bytes = full.publish(version)
        publish_full = time.perf_counter() - t0
        if cold:
            drop_from_cache([path])
        t0 = time.perf_counter()
        full.read(path, worker_full)
        read_full = time.perf_counter() - t0
        if version % before_every == 0:
            path, _ = before_deltas.publish(version)
            if cold:
                drop_from_cache([path])
            t0 = time.perf_counter()
            before_deltas.read(path, worker_full)
            before_read_ms.append((time.perf_counter() - t0) * 1e3)
        row = dict(version=version, anchor=anchor, bytes=publisher.published_bytes, full_bytes=full_bytes,
                   publish_ms=publish_delta * 1e3, full_publish_ms=publish_full * 1e3, read_ms=read_delta * 1e3,
                   full_read_ms=read_full * 1e3)
        rows.append(row)
        print(f"v{version:<4d} {'anchor' if anchor else 'delta ':6s} {row['bytes'] / 1e6:8.2f} {full_bytes / 1e6:8.2f} "
              f"{row['bytes'] / full_bytes:6.3f} | {row['publish_ms']:8.1f} {row['full_publish_ms']:8.1f} | "
              f"{row['read_ms']:8.1f} {row['full_read_ms']:8.1f}"
              + (f" | before deltas {before_read_ms[-1]:.1f}" if version % before_every == 0 else ""), flush=True)
    published = {name: t.detach().to(dtype) for name, t in shared_tensors(model).items()}
    held = shared_tensors(worker_deltas)
    identical = all(torch.equal(deltas.flat_bits(held[n]), deltas.flat_bits(published[n])) for n in published)
    subscriber.close()
    publisher.close()
    between = [r for r in rows if not r["anchor"]] or rows

    def median(key: str) -> float:
        return statistics.median(r[key] for r in between)

    if xor is not None:
        row = rows[xor_at - 1]
        print(f"v{xor_at} as the XOR of its bits with v{xor_at - 1}'s, zlib level 1: {xor['bytes'] / 1e6:.2f} MB "
              f"({xor['bytes'] / row['full_bytes']:.3f} of full) in {xor['ms']:.0f} ms; as positions and values: "
              f"{row['bytes'] / 1e6:.2f} MB ({row['bytes'] / row['full_bytes']:.3f}) in {row['publish_ms']:.0f} ms, "
              "writing included")
    return dict(lr=lr, versions=versions, anchors=sum(r["anchor"] for r in rows),
                delta_bytes_ratio_median=median("bytes") / median("full_bytes"),
                delta_bytes_ratio_max=max(r["bytes"] / r["full_bytes"] for r in between),
                publish_ms_median=median("publish_ms"), full_publish_ms_median=median("full_publish_ms"),
                read_ms_median=median("read_ms"), full_read_ms_median=median("full_read_ms"),
                read_ratio=median("read_ms") / median("full_read_ms"),
                before_read_ms_median=statistics.median(before_read_ms) if before_read_ms else float("nan"),
                bit_identical=identical)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--lrs", default="1e-6,1e-5")
    parser.add_argument("--versions", default="100,30", help="per learning rate, in the order of --lrs")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--xor-at", type=int, default=3, help="the version also written the other way, XOR and zlib")
    parser.add_argument("--before-every", type=int, default=5,
                        help="every how many versions a whole float32 file is also written and read")
    parser.add_argument("--cold", action="store_true",
                        help="drop each file from the page cache before it is read: reads come from the disk")
    args = parser.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]
    counts = [int(x) for x in args.versions.split(",")]
    print(f"{args.shape} shape, float32 PS, bfloat16 files, anchor every {ANCHOR_EVERY} versions; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; reads {'from the disk' if args.cold else 'from the page cache'}")
    root = Path(tempfile.mkdtemp(prefix="weight-deltas-"))
    try:
        results = [run_lr(args.shape, lr, n, args.batch, args.tokens, root, args.xor_at, args.before_every, args.cold)
                   for lr, n in zip(lrs, counts, strict=True)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\nbetween anchors (medians): lr, versions, bytes delta/full (median, max), publish ms delta vs full, "
          "read-and-apply ms delta vs full (ratio) and vs before deltas (a float32 file: ratio), bit-identical after "
          "the last version")
    for r in results:
        print(f"lr {r['lr']:g}: {r['versions']} versions ({r['anchors']} anchors), "
              f"bytes {r['delta_bytes_ratio_median']:.3f} (max {r['delta_bytes_ratio_max']:.3f}), "
              f"publish {r['publish_ms_median']:.0f} vs {r['full_publish_ms_median']:.0f} ms, "
              f"read {r['read_ms_median']:.0f} vs {r['full_read_ms_median']:.0f} ms ({r['read_ratio']:.3f}), "
              f"vs {r['before_read_ms_median']:.0f} ms before deltas "
              f"({r['read_ms_median'] / r['before_read_ms_median']:.3f}), "
              f"bit-identical {r['bit_identical']}")

if __name__ == "__main__":
    main()
