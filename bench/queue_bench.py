"""Benchmark of the file-system job queue (asyncgrpo.jobqueue), fsync on everywhere.

Measures, in one run, and prints ONE JSON object on stdout (progress on stderr):

1. Handoff latency, one job at a time to an idle waiter in another process, >= 300 each,
   event-driven (QueueWatcher, inotify) and with the original 50 ms polling loop:
   a. pending -> worker: the PS process writes a job (put_job); a worker process waiting on
      QueueWatcher({PENDING}) claims it. latency = claim() returned - file appeared.
   b. complete -> collector: a worker publishes a result (complete()); the PS process waiting
      on QueueWatcher({COMPLETE}) collects it. latency = collect() returned - file appeared.
   "appeared" is taken right after the file is linked under its final name (a thin wrapper
   around fileops.publish adds a time.monotonic() between its link+unlink and its directory
   fsync). The brief's definitions (after put_job() / complete() return) are reported as
   well; they can be negative, since the waiter may act during the directory fsync (and,
   for complete(), the fence archive) that follows the link.
2. Full-lifecycle throughput (put -> claim -> complete -> collect -> consume) with 1 and 3
   worker processes, each holding a WorkerPresence, PS and workers woken by events; checks
   that every job id was consumed exactly once.
3. `python -m queue_tools ls RUN --json` wall time on a run whose done/ holds 100,000 files.

Run:  /tmp/venvtest/bin/python bench/queue_bench.py [--run-root DIR] [--handoffs N] [--jobs N] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import random
import statistics
import subprocess
import sys
import tempfile
import time

from asyncgrpo.jobqueue import (ArchiveReason, JobQueue, JobState, QueueWatcher, RunDir, WorkerPresence,
                                fileops, make_job_id)
from asyncgrpo.jobqueue.names import done_name, done_reason

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CTX = mp.get_context("spawn")
CHILDREN: list = []
WARMUP = 10
_orig_publish = fileops.publish
_last_link = [0.0]


def _publish_timed(tmp_path, final_path, *, fsync=True):
    """fileops.publish with a timestamp taken once the final name exists (before the dir fsync)."""
    _orig_publish(tmp_path, final_path, fsync=False)
    _last_link[0] = time.monotonic()
    if fsync:
        fileops.fsync_dir(os.path.dirname(os.fspath(final_path)))


fileops.publish = _publish_timed  # installed in every process that imports this file


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def stats(xs: list[float]) -> dict:
    s = sorted(x * 1e3 for x in xs)
    pick = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]  # noqa: E731
    return {"p50_ms": round(pick(0.5), 3), "p99_ms": round(pick(0.99), 3),
            "mean_ms": round(statistics.fmean(s), 3), "max_ms": round(s[-1], 3), "n": len(s)}


def job_data(i: int) -> dict:
    import torch
    return {"prompt_ids": torch.arange(32, dtype=torch.int64) + i, "prompt": f"question {i}: what is 2+{i}?"}


def job_id(i: int) -> str:
    return make_job_id(i // 1000, i % 1000)


def spawn(target, *args):
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    CHILDREN.append(p)
    return p


def stop_children(stop) -> None:
    stop.set()
    for p in CHILDREN:
        p.join(timeout=3)
        if p.is_alive():
            p.terminate()
            p.join(timeout=3)
    CHILDREN.clear()


# ------------------------------------------------------------------ worker processes

def worker_main(root, device, role, use_events, rescan_s, out, stop, seed):
    """role: 'claim' (report claim times), 'complete' (report publish times), 'full' (lifecycle)."""
    import torch  # noqa: F401  (loaded before the first job, not during it)
    run = RunDir.open(root)
    q = JobQueue(run)
    rng = random.Random(seed)
    presence = WorkerPresence(run, device).start()
    watcher = QueueWatcher(run.queue, {JobState.PENDING}, use_events=use_events, rescan_s=rescan_s)
    timeouts = 0
    out.put(("ready", device))
    try:
        while not stop.is_set():
            job = q.claim(device)
            if job is None:
                timeouts += not watcher.wait()
                continue
            t_claim = time.monotonic()
            presence.update(job_id=job.job_id)
            if role == "claim":
                q.archive(job.path, job.job_id, ArchiveReason.PROCESSED)
                out.put((job.job_id, t_claim))
                continue
            if role == "complete":
                time.sleep(rng.uniform(0.002, 0.010))  # the collector is genuinely idle
            q.complete(job, {"completion_ids": torch.arange(16), "text": "4"}, weights_version=0)
            if role == "complete":
                out.put((job.job_id, _last_link[0], time.monotonic()))
    finally:
        out.put(("timeouts", device, timeouts))
        watcher.close()
        presence.stop()


def await_ready(out, n: int) -> None:
    deadline = time.monotonic() + 60
    while n:
        if any(not p.is_alive() for p in CHILDREN) or time.monotonic() > deadline:
            raise RuntimeError("a worker process died or never started (see its traceback above)")
        with contextlib.suppress(queue_mod.Empty):
            msg = out.get(timeout=0.2)
            assert msg[0] == "ready", msg
            n -= 1


# ------------------------------------------------------------------ measurements

def handoff_pending(root: str, n: int, use_events: bool, seed: int) -> dict:
    run = RunDir.create(root)
    q = JobQueue(run)
    out, stop = CTX.Queue(), CTX.Event()
    rng = random.Random(seed)
    spawn(worker_main, root, 0, "claim", use_events, None if use_events else 0.05, out, stop, seed)
    try:
        await_ready(out, 1)
        from_link, from_return, put_s = [], [], []
        for i in range(n + WARMUP):
            time.sleep(rng.uniform(0.002, 0.010))
            data = job_data(i)
            t0 = time.monotonic()
            q.put_job(job_id(i), data, created_step=i // 1000)
            t_return = time.monotonic()
            t_link = _last_link[0]
            jid, t_claim = out.get(timeout=10)
            assert jid == job_id(i), (jid, i)
            if i >= WARMUP:
                from_link.append(t_claim - t_link)
                from_return.append(t_claim - t_return)
                put_s.append(t_return - t0)
    finally:
        stop_children(stop)
    return {**stats(from_link), "from_put_return": stats(from_return), "put_job": stats(put_s)}


def handoff_complete(root: str, n: int, use_events: bool, seed: int) -> dict:
    run = RunDir.create(root)
    q = JobQueue(run)
    out, stop = CTX.Queue(), CTX.Event()
    spawn(worker_main, root, 0, "complete", True, None, out, stop, seed)
    watcher = QueueWatcher(run.queue, {JobState.COMPLETE}, use_events=use_events,
                           rescan_s=None if use_events else 0.05)
    try:
        await_ready(out, 1)
        from_link, from_return, timeouts = [], [], 0
        for i in range(n + WARMUP):
            q.put_job(job_id(i), job_data(i), created_step=i // 1000)
            got = []
            while not got:
                got = q.collect()
                if got:
                    t_held = time.monotonic()
                else:
                    timeouts += not watcher.wait()
            assert [r.job_id for r in got] == [job_id(i)], [r.job_id for r in got]
            q.consume(got[0])
            jid, t_link, t_return = out.get(timeout=10)
            if i >= WARMUP:
                from_link.append(t_held - t_link)
                from_return.append(t_held - t_return)
    finally:
        watcher.close()
        stop_children(stop)
    return {**stats(from_link), "from_complete_return": stats(from_return), "collector_rescan_wakes": timeouts}


def throughput(root: str, n_jobs: int, n_workers: int, max_pending: int, seed: int) -> dict:
    run = RunDir.create(root)
    q = JobQueue(run)
    out, stop = CTX.Queue(), CTX.Event()
    for dev in range(n_workers):
        spawn(worker_main, root, dev, "full", True, None, out, stop, seed + dev)
    watcher = QueueWatcher(run.queue, {JobState.COMPLETE, JobState.PROCESSING})
    try:
        await_ready(out, n_workers)
        datas = [job_data(i) for i in range(n_jobs)]
        put = consumed = waits = 0
        t0 = time.monotonic()
        while consumed < n_jobs:
            progressed = False
            pending = sum(1 for name in q.scan()[0] if name.state is JobState.PENDING)
            while pending < max_pending and put < n_jobs:
                q.put_job(job_id(put), datas[put], created_step=put // 1000)
                put, pending, progressed = put + 1, pending + 1, True
            for result in q.collect():
                consumed += q.consume(result)
                progressed = True
            if not progressed:
                waits += 1
                watcher.wait()
        elapsed = time.monotonic() - t0
    finally:
        watcher.close()
        stop_children(stop)
    worker_rescan_wakes = 0
    with contextlib.suppress(queue_mod.Empty):
        while True:
            msg = out.get(timeout=1)
            worker_rescan_wakes += msg[2] if msg[0] == "timeouts" else 0
    names = os.listdir(run.done)
    consumed_ids = [n[: -len("_consumed.pt")] for n in names if n.endswith("_consumed.pt")]
    expected = {job_id(i) for i in range(n_jobs)}
    ok = len(consumed_ids) == n_jobs and set(consumed_ids) == expected
    reasons = collections.Counter(done_reason(n).value for n in names if done_reason(n))
    return {"workers": n_workers, "jobs": n_jobs, "max_pending": max_pending, "seconds": round(elapsed, 3),
            "lifecycles_per_s": round(n_jobs / elapsed, 1), "exactly_once_ok": ok,
            "done_reasons": dict(reasons),
            "queue_left": [e.name for e in fileops.scan(run.queue) if e.name != ".tmp"],
            "ps_event_waits": waits, "worker_rescan_wakes": worker_rescan_wakes}


def queue_tools_ls(root: str, n_done: int, seed: int) -> dict:
    rng = random.Random(seed)
    run = RunDir.create(root)
    others = [ArchiveReason.PROCESSED] * 90 + [ArchiveReason.STALE] * 4 + [
        ArchiveReason.DUPLICATE, ArchiveReason.FAILED_LOAD, ArchiveReason.ORPHANED, ArchiveReason.FAILED] * 1
    for i in range(n_done):  # job i//2 consumed, plus one other reason
        reason = ArchiveReason.CONSUMED if i % 2 == 0 else rng.choice(others)
        os.close(os.open(run.done / done_name(job_id(i // 2), reason), os.O_WRONLY | os.O_CREAT, 0o644))
    q = JobQueue(run)
    base = n_done // 2
    for k in range(8):
        q.put_job(job_id(base + k), job_data(k), created_step=(base + k) // 1000)
    presences = [WorkerPresence(run, dev).start() for dev in (0, 1)]
    try:
        for dev in (0, 1):
            job = q.claim(dev)
            presences[dev].update(job_id=job.job_id)
        cmd = [sys.executable, "-m", "queue_tools", "ls", str(run.root), "--json"]
        walls, rc, err = [], None, ""
        for _ in range(3):
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            walls.append(time.monotonic() - t0)
            rc, err = proc.returncode, proc.stderr.strip()[-300:]
        floor = subprocess.run([sys.executable, "-c", "import time; t=time.monotonic(); "
                                "import asyncgrpo.jobqueue; print(time.monotonic()-t)"],
                               capture_output=True, text=True)
        result = {"command": " ".join(cmd[1:]), "returncode": rc, "ran_ok": rc == 0,
                  "wall_best_s": round(min(walls), 4), "wall_median_s": round(statistics.median(walls), 4),
                  "import_asyncgrpo_jobqueue_s": round(float(floor.stdout or "nan"), 4),
                  "done_files": len(os.listdir(run.done))}
        if rc != 0:
            result["stderr_tail"] = err
        result["in_process"] = ls_in_process(str(run.root))
    finally:
        for p in presences:
            p.stop()
    return result


def ls_in_process(root: str) -> dict:
    try:
        from queue_tools import cli
    except ImportError as err:
        return {"skipped": f"queue_tools.cli not importable: {err}"}
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            cli.main(["ls", root, "--json"])
        times.append(time.monotonic() - t0)
    return {"function": "queue_tools.cli.main(['ls', RUN, '--json'])",
            "best_s": round(min(times), 4), "median_s": round(statistics.median(times), 4)}


# ------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-root", default=None)
    ap.add_argument("--handoffs", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--done-files", type=int, default=100_000)
    ap.add_argument("--quick", action="store_true", help="small counts, a smoke run in ~20 s")
    args = ap.parse_args()
    if args.quick:
        args.handoffs, args.jobs, args.done_files = 40, 300, 10_000
    root = args.run_root or tempfile.mkdtemp(prefix="queue_bench_", dir="/tmp")
    os.makedirs(root, exist_ok=True)
    seed = 1234
    report = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0], "run_root": os.path.abspath(root)}}
    handoff = {}
    for kind, fn in (("pending_to_worker", handoff_pending), ("complete_to_collector", handoff_complete)):
        row = {}
        for mode, events in (("event", True), ("poll_50ms", False)):
            log(f"handoff {kind} {mode} x{args.handoffs}")
            row[mode] = fn(os.path.join(root, f"handoff_{kind}_{mode}"), args.handoffs, events, seed)
        row["poll_over_event_p50"] = round(row["poll_50ms"]["p50_ms"] / row["event"]["p50_ms"], 1)
        row["poll_over_event_p99"] = round(row["poll_50ms"]["p99_ms"] / row["event"]["p99_ms"], 1)
        handoff[kind] = row
    report["handoff"] = handoff
    report["throughput"] = {}
    for n_workers in (1, 3):
        log(f"throughput {n_workers} worker(s) x{args.jobs} jobs")
        report["throughput"][f"{n_workers}_workers"] = throughput(
            os.path.join(root, f"throughput_{n_workers}w"), args.jobs, n_workers, 16, seed)
    log(f"queue_tools ls with {args.done_files} done/ files")
    report["queue_tools_ls"] = queue_tools_ls(os.path.join(root, "ls_run"), args.done_files, seed)
    ev = [handoff[k] for k in handoff]
    ls = report["queue_tools_ls"]
    report["goals"] = {
        "handoff_p50_le_1ms": all(r["event"]["p50_ms"] <= 1.0 for r in ev),
        "handoff_p99_le_5ms": all(r["event"]["p99_ms"] <= 5.0 for r in ev),
        "handoff_ge_20x_poll": all(min(r["poll_over_event_p50"], r["poll_over_event_p99"]) >= 20 for r in ev),
        "throughput_3w_ge_1000_per_s": report["throughput"]["3_workers"]["lifecycles_per_s"] >= 1000,
        "exactly_once": all(t["exactly_once_ok"] for t in report["throughput"].values()),
        "queue_tools_ls_le_1s": bool(ls["ran_ok"] and ls["wall_best_s"] <= 1.0
                                     and ls["done_files"] >= 100_000),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    try:
        main()
    finally:
        for child in CHILDREN:
            child.terminate()
            child.join(timeout=3)
