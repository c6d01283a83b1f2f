"""Benchmark of the weight transports (asyncgrpo.weights). Prints ONE JSON object on stdout.

CPU (default): a Qwen2.5-0.5B-shaped model (494M parameters, 290 tensors, tied embeddings;
built from a transformers config, no download), fp32 (2 GB) unless --dtype bf16. The PS
model publishes through the mmap transport (/dev/shm) and a subscriber syncs into a
second model; both sides map the files, as in separate processes (the copy costs the
same; the lock and version-file traffic is real). All figures from the same run, median
of --iters after one warm-up, next to plain copies of the same bytes:
  * memcpy_flat:        one ``dst.copy_(src)`` of the same total bytes (two plain tensors)
  * memcpy_per_tensor:  ``torch._foreach_copy_`` PS model -> worker model, tensor by tensor
  * publish / memcpy_flat and sync / memcpy_flat: the goal is within 2x each.

--adapter (CPU and GPU): LoRA, as ``--use_peft`` shares it: an r16 all-linear adapter
(PEFT's LoraConfig, fp32 as PEFT makes it) on the same model, of which the PS publishes
and the worker syncs only the adapter; measured next to the whole model in the same run
(bytes, ms, ratio to a flat copy of the same bytes, and the adapter's share of the
whole). CPU: the 0.5B shape; GPU: the 0.5B and the 1.5B shapes, bf16 bases.

GPU (--gpu): a Qwen2.5-1.5B-shaped model (1.54B parameters, bf16, 3.1 GB) on cuda:0
publishes through cuda_ipc; a worker process (spawned) on --reader-device syncs after
each publish; its sync time (lock + version file + batched device-to-device copy +
synchronize) and the PS's publish time are reported next to a raw device-to-device copy
of the same bytes (one flat ``copy_``), all from the same run. Goal: sync <= 10 ms on one
H200. ``scripts/gpu_check.sh`` runs it and prints the figures.

Run:  .venv/bin/python bench/weights_bench.py [--dtype fp32|bf16] [--iters N] [--layers N] [--threads N] [--adapter]
      python bench/weights_bench.py --gpu [--reader-device cuda:0] [--iters N] [--adapter]
(temp run dirs under /tmp, removed at the end)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncgrpo.run import RunDir
from asyncgrpo.weights import make_publisher, make_subscriber
from asyncgrpo.weights.adapter import shared_tensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
READER_TIMEOUT_S = 180.0  # the GPU reader's first answer includes its start-up and building its model
SHAPES = {  # Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
}


def unique_numel(tensors: dict[str, torch.Tensor]) -> int:
    """Parameters counted once each: a tied pair (embedding and LM head) is one tensor under two names."""
    return sum(t.numel() for t in {t.data_ptr(): t for t in tensors.values()}.values())


def build(size: str, dtype: torch.dtype, device: str, layers: int | None, value: float,
          adapter: bool = False) -> torch.nn.Module:
    """The real module tree, allocated without random init (slow for 0.5B), then touched. With ``adapter``:
    wrapped with an r16 all-linear LoRA adapter (the base keeps ``value``, the adapter gets it too)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(SHAPES[size], vocab_size=151936, tie_word_embeddings=True)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(dtype)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each name its own tensor
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(value)
    if adapter:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32,
                                                 target_modules="all-linear"))
        fill_shared(model, value)
    return model


def fill_shared(model: torch.nn.Module, value: float) -> None:
    """What a publish changes: the whole model, or only the adapter (the base must stay the workers')."""
    with torch.no_grad():
        for t in shared_tensors(model).values():
            t.fill_(value)


def nbytes(model: torch.nn.Module) -> int:
    """Bytes a sync copies: the shared tensors, each memory once (tied ones are published once)."""
    tensors = shared_tensors(model).values()
    return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())


def timed(fn, iters: int, sync=lambda: None) -> list[float]:
    out = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float]) -> dict:
    return {"median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2)}


def _flat_copy_ms(total: int, iters: int) -> list[float]:
    src, dst = torch.ones(total, dtype=torch.uint8), torch.zeros(total, dtype=torch.uint8)
    dst.copy_(src)  # both touched: no page faults in the timed copies
    return timed(lambda: dst.copy_(src), iters)


def cpu_bench(args) -> dict:
    if not args.adapter:
        return cpu_transport_bench(args, adapter=False)
    full = cpu_transport_bench(args, adapter=False)
    adapter = cpu_transport_bench(args, adapter=True)
    return {"mode": "cpu", "transport": "mmap", "shape": "0.5b", "base_dtype": args.dtype, **compare(full, adapter)}


def compare(full: dict, adapter: dict) -> dict:
    """The whole model's and the adapter's figures, side by side."""
    keep = ("bytes", "tensors", "publish", "sync", "memcpy_flat", "memcpy_d2d", "publish_over_memcpy",
            "sync_over_memcpy", "first_sync_ms (opens handles)", "synced_state_equal", "all_syncs_correct")
    return {"full": {k: full[k] for k in keep if k in full}, "adapter": {k: adapter[k] for k in keep if k in adapter},
            "adapter_bytes_fraction": round(adapter["bytes"] / full["bytes"], 4),
            "adapter_sync_ms_fraction": round(adapter["sync"]["median_ms"] / full["sync"]["median_ms"], 4),
            "adapter_publish_ms_fraction": round(adapter["publish"]["median_ms"] / full["publish"]["median_ms"], 4)}


def cpu_transport_bench(args, adapter: bool) -> dict:
    dtype = DTYPES[args.dtype]
    root = Path(tempfile.mkdtemp(prefix="weights-bench-"))
    try:
        run = RunDir.create(root / "run")
        # With an adapter both bases hold the same values (a worker on another base is refused); the adapters differ.
        ps = build("0.5b", dtype, "cpu", args.layers, 1.0 if not adapter else 0.5, adapter)
        worker = build("0.5b", dtype, "cpu", args.layers, 0.0 if not adapter else 0.5, adapter)
        fill_shared(ps, 1.0)
        fill_shared(worker, 0.0)
        total = nbytes(ps)
        t0 = time.perf_counter()
        publisher, subscriber = make_publisher(run, ps, "mmap"), make_subscriber(run)
        create_ms = (time.perf_counter() - t0) * 1e3
        version = [0]

        def publish():
            version[0] += 1
            publisher.publish(version[0], version[0])

        def sync():
            assert subscriber.sync(worker) == version[0]

        publish()
        t0 = time.perf_counter()
        sync()  # warm-up: maps the files, first touch of the worker's mapping
        first_sync_ms = (time.perf_counter() - t0) * 1e3
        publish_ms, sync_ms = [], []
        for _ in range(args.iters):
            publish_ms += timed(publish, 1)
            sync_ms += timed(sync, 1)
        ok = all(torch.equal(a, b) for a, b in zip(ps.state_dict().values(), worker.state_dict().values(),
                                                   strict=True))
        publisher.close()
        subscriber.close()

        flat_ms = _flat_copy_ms(total, args.iters)
        names = list(publisher.layout.entries)
        srcs = [shared_tensors(ps)[e.name] for e in names]
        dsts = [shared_tensors(worker)[e.name] for e in names]
        with torch.no_grad():  # the adapter's tensors require grad
            per_tensor_ms = timed(lambda: torch._foreach_copy_(dsts, srcs), args.iters)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    pub, syn, flat = summary(publish_ms), summary(sync_ms), summary(flat_ms)
    return {
        "mode": "cpu", "transport": "mmap", "dtype": args.dtype if not adapter else "fp32 (adapter)",
        "shared": "adapter" if adapter else "full", "params": unique_numel(shared_tensors(ps)),
        "bytes": total, "tensors": len(names), "iters": args.iters, "torch_threads": torch.get_num_threads(),
        "publisher_create_ms": round(create_ms, 1), "first_sync_ms": round(first_sync_ms, 1),
        "publish": pub, "sync": syn, "memcpy_flat": flat, "memcpy_per_tensor": summary(per_tensor_ms),
        "publish_GBps": round(total / pub["median_ms"] / 1e6, 2), "sync_GBps": round(total / syn["median_ms"] / 1e6, 2),
        "memcpy_GBps": round(total / flat["median_ms"] / 1e6, 2),
        "publish_over_memcpy": round(pub["median_ms"] / flat["median_ms"], 2),
        "sync_over_memcpy": round(syn["median_ms"] / flat["median_ms"], 2),
        "goal": "publish and sync each within 2x of memcpy_flat (medians)",
        "goal_met": pub["median_ms"] <= 2 * flat["median_ms"] and syn["median_ms"] <= 2 * flat["median_ms"],
        "synced_state_equal": ok,
    }


def _gpu_reader(root: str, device: str, layers, conn, size: str = "1.5b", adapter: bool = False) -> None:
    run = RunDir.open(root)
    model = build(size, torch.bfloat16, device, layers, 0.0 if not adapter else 0.5, adapter)  # the PS's base
    fill_shared(model, 0.0)
    first_shared = next(iter(shared_tensors(model).values()))
    subscriber = make_subscriber(run)
    while conn.recv() is not None:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        got = subscriber.sync(model)  # returns after its copy has finished (synchronize inside)
        conn.send(((time.perf_counter() - t0) * 1e3, got, float(first_shared.view(-1)[0])))
    subscriber.close()


def gpu_bench(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA")
    if not args.adapter:
        return gpu_transport_bench(args, "1.5b", adapter=False)
    out = {"mode": "gpu", "transport": "cuda_ipc", "base_dtype": "bf16", "device": torch.cuda.get_device_name(0),
           "reader_device": args.reader_device, "iters": args.iters}
    for size in ("0.5b", "1.5b"):
        full = gpu_transport_bench(args, size, adapter=False)
        out[size] = compare(full, gpu_transport_bench(args, size, adapter=True))
    return out


def gpu_transport_bench(args, size: str, adapter: bool) -> dict:
    root = Path(tempfile.mkdtemp(prefix="weights-bench-"))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    reader = ctx.Process(target=_gpu_reader, args=(str(root / "run"), args.reader_device, args.layers, child, size,
                                                   adapter))
    try:
        run = RunDir.create(root / "run")
        ps = build(size, torch.bfloat16, "cuda:0", args.layers, 1.0 if not adapter else 0.5, adapter)
        total = nbytes(ps)
        publisher = make_publisher(run, ps)
        reader.start()
        publish_ms, sync_ms, results = [], [], []
        for v in range(1, args.iters + 2):  # the first sync opens the handles: reported apart
            fill_shared(ps, float(v))
            publish_ms += timed(lambda v=v: publisher.publish(v, v), 1, lambda: torch.cuda.synchronize(0))
            parent.send(v)
            if not parent.poll(READER_TIMEOUT_S):  # a reader that died (or hangs) must not hang the bench
                raise SystemExit(f"the reader process gave no answer for version {v} within {READER_TIMEOUT_S:.0f} s "
                                 f"(exit code {reader.exitcode})")
            ms, got, value = parent.recv()
            sync_ms.append(ms)
            results.append(got == v and value == float(v))
        parent.send(None)
        reader.join(60)
        publisher.close()
        src = torch.ones(total, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(total, dtype=torch.uint8, device=args.reader_device)
        both = lambda: [torch.cuda.synchronize(d) for d in ("cuda:0", args.reader_device)]  # noqa: E731
        flat_ms = timed(lambda: dst.copy_(src), args.iters, both)
    finally:
        if reader.is_alive():
            reader.kill()
        shutil.rmtree(root, ignore_errors=True)
    syn, pub, flat = summary(sync_ms[1:]), summary(publish_ms[1:]), summary(flat_ms)
    return {
        "mode": "gpu", "transport": "cuda_ipc", "dtype": "bf16" if not adapter else "fp32 (adapter)", "shape": size,
        "shared": "adapter" if adapter else "full", "params": unique_numel(shared_tensors(ps)),
        "bytes": total, "tensors": len(publisher.layout.entries),
        "device": torch.cuda.get_device_name(0), "reader_device": args.reader_device, "iters": args.iters,
        "first_sync_ms (opens handles)": round(sync_ms[0], 2), "publish": pub, "sync": syn,
        "memcpy_d2d": flat, "sync_over_memcpy": round(syn["median_ms"] / flat["median_ms"], 2),
        "publish_over_memcpy": round(pub["median_ms"] / flat["median_ms"], 2),
        "sync_GBps": round(total / syn["median_ms"] / 1e6, 1), "memcpy_GBps": round(total / flat["median_ms"] / 1e6, 1),
        "goal": "sync <= 10 ms (median)", "goal_met": syn["median_ms"] <= 10.0, "all_syncs_correct": all(results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="CPU mode only (GPU: bf16)")
    parser.add_argument("--adapter", action="store_true",
                        help="also an r16 all-linear LoRA adapter, shared alone, next to the whole model")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run")
    parser.add_argument("--reader-device", default="cuda:0")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU mode)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = gpu_bench(args) if args.gpu else cpu_bench(args)
    result.update(python=sys.version.split()[0], torch=torch.__version__, machine=platform.machine())
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
