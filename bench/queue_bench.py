"""Benchmark of the file-system job queue (asyncgrpo.jobqueue), fsync on everywhere.

Prints ONE JSON object on stdout (progress on stderr), all figures from the same run:
1. Handoff latency to an idle waiter in another process, one job at a time, event-driven
   (QueueWatcher, inotify) and with a plain 50 ms poll (use_events=False, rescan_s=0.05):
   a. pending -> worker: latency = worker's claim() returned - the pending file appeared;
   b. complete -> collector: latency = PS's collect() returned - the result file appeared.
   "Appeared" = time.monotonic() just before fileops.publish links the file under its final
   name (a wrapper around fileops.publish; an upper bound by the link's few microseconds).
   The writer-side anchors (put_job()/complete() returned) are reported too: the waiter often acts
   while the writer is still in its directory fsync, so they understate. Gaps between jobs are
   2-10 ms + uniform(0, 50 ms), so arrivals are not phase-locked to the 50 ms poll.
2. Lifecycles/s (put -> claim -> complete -> collect -> consume) with 1 and 3 worker processes
   (each holds a WorkerPresence), PS and workers woken by events; exactly-once check; CPU ms
   per lifecycle summed over all processes.
3. `python -m queue_tools ls RUN --json` wall time with 100,000 files in done/.
Workers are spawned once and given one phase at a time. CLOCK_MONOTONIC is system-wide.

Run:  .venv/bin/python bench/queue_bench.py [--run-root DIR] [--handoffs N] [--jobs N]
                                            [--done-files N] [--quick]
(.venv is made by `bash scripts/test.sh`.) Two readings of "the worker holds the job":
it owns it (claim_rename_done / collect_rename_done: its rename succeeded) and it has
loaded it (the headline p50/p99: claim()/collect() returned, torch.load included).
(run dirs go to a new temp dir under /tmp, removed at the end; a --run-root is kept.)
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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from asyncgrpo.jobqueue import ArchiveReason, JobQueue, JobState, QueueWatcher, make_job_id
from asyncgrpo.jobqueue.names import done_name, done_reason
from asyncgrpo.run import RunDir, WorkerPresence, fileops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CTX = mp.get_context("spawn")
WARMUP = 10  # first handoffs of each phase, not counted
STOP_CHECK_S = 0.2  # a waiting worker checks the phase's stop flag this often
POLL_S = 0.05  # the plain poll the events are compared with
STAMPS: dict[str, float] = {}  # this process's latest publish (taken before the link) and move (after)
T0 = time.monotonic()


def _stamped(fn, key: str, before: bool):
    def wrapper(*args, **kwargs):
        if before:
            STAMPS[key] = time.monotonic()
        result = fn(*args, **kwargs)
        if not before:
            STAMPS[key] = time.monotonic()
        return result
    return wrapper


# In every process that imports this file; fileops resolves these names at call time.
fileops.publish = _stamped(fileops.publish, "publish", before=True)
fileops.move = _stamped(fileops.move, "move", before=False)


def log(msg: str) -> None:
    print(f"[bench {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def stats(xs: list[float]) -> dict:
    s = sorted(x * 1e3 for x in xs)
    pick = lambda q: round(s[min(len(s) - 1, int(round(q * (len(s) - 1))))], 3)  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "mean_ms": round(statistics.fmean(s), 3),
            "max_ms": pick(1.0), "n": len(s)}


def gap(rng: random.Random) -> float:
    return rng.uniform(0.002, 0.010) + rng.uniform(0, POLL_S)


def job_id(i: int) -> str:
    return make_job_id(i // 1000, i % 1000)


def job_data(i: int) -> dict:
    import torch
    return {"prompt_ids": torch.arange(32, dtype=torch.int64) + i, "prompt": f"question {i}: what is 2+{i}?"}


# ------------------------------------------------------------------ worker processes

def worker_proc(cmds, out, stop) -> None:
    import torch  # noqa: F401  (paid once, before any measurement)
    out.put(("up",))
    while (cmd := cmds.get()) is not None:
        worker_phase(*cmd, out=out, stop=stop)


def worker_phase(root, device, role, use_events, seed, *, out, stop) -> None:
    """role 'claim': report claim times; 'complete': report publish times; 'full': lifecycle."""
    import torch
    run = RunDir.open(root)
    q, rng = JobQueue(run), random.Random(seed)
    presence = WorkerPresence(run, device).start()
    watcher = QueueWatcher(run.queue, {JobState.PENDING}, use_events=use_events,
                           rescan_s=None if use_events else POLL_S)
    after_rescan, woke_by_event, cpu0 = 0, True, cpu_s()
    out.put(("ready", device))
    try:
        while not stop.is_set():
            job = q.claim(device)
            if job is None:
                woke_by_event = watcher.wait(STOP_CHECK_S)
                continue
            t_claim, t_moved = time.monotonic(), STAMPS["move"]
            after_rescan += use_events and not woke_by_event
            presence.update(job_id=job.job_id)
            if role == "claim":
                q.archive(job.path, job.job_id, ArchiveReason.PROCESSED)
                out.put((job.job_id, t_claim, t_moved))
                continue
            if role == "complete":
                time.sleep(gap(rng))  # the collector is idle, at a random phase of its poll
            q.complete(job, {"completion_ids": torch.arange(16), "text": "4"}, weights_version=0)
            if role == "complete":
                out.put((job.job_id, STAMPS["publish"], time.monotonic()))
    finally:
        watcher.close()
        presence.stop()
        out.put(("done", device, after_rescan, cpu_s() - cpu0))


class Pool:
    """Persistent spawned workers; ``phase`` runs worker_phase on some of them."""

    def __init__(self, n: int):
        self.out, self.stop = CTX.Queue(), CTX.Event()
        self.cmds = [CTX.Queue() for _ in range(n)]
        self.procs = [CTX.Process(target=worker_proc, args=(c, self.out, self.stop), daemon=True)
                      for c in self.cmds]
        for p in self.procs:
            p.start()
        self.expect("up", n)

    def expect(self, tag: str, n: int, timeout: float = 120) -> list:
        got, deadline = [], time.monotonic() + timeout
        while len(got) < n:
            if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                raise RuntimeError(f"worker processes died or hung waiting for {tag!r} (traceback above)")
            with contextlib.suppress(queue_mod.Empty):
                msg = self.out.get(timeout=0.2)
                assert msg[0] == tag, msg
                got.append(msg)
        return got

    @contextlib.contextmanager
    def phase(self, n: int, root: str, role: str, use_events: bool, seed: int):
        """Runs worker_phase on workers (devices) 0..n-1 until the block ends; yields their 'done' list."""
        self.stop.clear()
        for dev in range(n):
            self.cmds[dev].put((root, dev, role, use_events, seed + dev))
        self.expect("ready", n)
        done: list = []
        try:
            yield done
        finally:
            self.stop.set()
            done += self.expect("done", n)

    def close(self) -> None:
        self.stop.set()
        for c in self.cmds:
            c.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


# ------------------------------------------------------------------ measurements

def handoff_pending(pool: Pool, root: str, n: int, use_events: bool, seed: int) -> dict:
    q, rng = JobQueue(RunDir.create(root)), random.Random(seed)
    from_link, from_return, owned, put_s = [], [], [], []
    with pool.phase(1, root, "claim", use_events, seed) as done:
        for i in range(n + WARMUP):
            time.sleep(gap(rng))
            data = job_data(i)
            t0 = time.monotonic()
            q.put_job(job_id(i), data, created_step=i // 1000)
            t_return, t_link = time.monotonic(), STAMPS["publish"]
            jid, t_claim, t_moved = pool.out.get(timeout=10)
            assert jid == job_id(i), (jid, i)
            if i >= WARMUP:
                from_link.append(t_claim - t_link)
                from_return.append(t_claim - t_return)
                owned.append(t_moved - t_link)
                put_s.append(t_return - t0)
    return {**stats(from_link), "claim_rename_done": stats(owned), "from_put_return": stats(from_return),
            "put_job_duration": stats(put_s), "claims_after_rescan": done[0][2]}


def handoff_complete(pool: Pool, root: str, n: int, use_events: bool, seed: int) -> dict:
    run = RunDir.create(root)
    q = JobQueue(run)
    watcher = QueueWatcher(run.queue, {JobState.COMPLETE}, use_events=use_events,
                           rescan_s=None if use_events else POLL_S)
    from_link, from_return, owned, after_rescan = [], [], [], 0
    try:
        with pool.phase(1, root, "complete", True, seed):  # the worker side always uses events
            for i in range(n + WARMUP):
                q.put_job(job_id(i), job_data(i), created_step=i // 1000)
                woke_by_event = True
                while not (got := q.collect()):
                    woke_by_event = watcher.wait()
                t_held, t_moved = time.monotonic(), STAMPS["move"]  # collect()'s rename; consume() moves nothing
                assert [r.job_id for r in got] == [job_id(i)], [r.job_id for r in got]
                q.consume(got[0])
                jid, t_link, t_return = pool.out.get(timeout=10)
                if i >= WARMUP:
                    from_link.append(t_held - t_link)
                    from_return.append(t_held - t_return)
                    owned.append(t_moved - t_link)
                    after_rescan += use_events and not woke_by_event
    finally:
        watcher.close()
    return {**stats(from_link), "collect_rename_done": stats(owned), "from_complete_return": stats(from_return),
            "collects_after_rescan": after_rescan}


def throughput(pool: Pool, root: str, n_jobs: int, n_workers: int, max_pending: int, seed: int) -> dict:
    run = RunDir.create(root)
    q = JobQueue(run)
    datas = [job_data(i) for i in range(n_jobs)]
    watcher = QueueWatcher(run.queue, {JobState.COMPLETE, JobState.PROCESSING})
    put = consumed = waits = 0
    long_waits: list[float] = []
    try:
        with pool.phase(n_workers, root, "full", True, seed) as done:
            t0, cpu0 = time.monotonic(), cpu_s()
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
                    t_wait, waits = time.monotonic(), waits + 1
                    watcher.wait()
                    if time.monotonic() - t_wait > 0.1:  # no result is due that late: a late event
                        long_waits.append(time.monotonic() - t_wait)
            elapsed, ps_cpu = time.monotonic() - t0, cpu_s() - cpu0
    finally:
        watcher.close()
    names = os.listdir(run.done)
    consumed_ids = [n[: -len("_consumed.pt")] for n in names if n.endswith("_consumed.pt")]
    workers_cpu = sum(m[3] for m in done)
    cpu_ms = (ps_cpu + workers_cpu) * 1e3 / n_jobs
    return {"workers": n_workers, "jobs": n_jobs, "max_pending": max_pending, "seconds": round(elapsed, 3),
            "lifecycles_per_s": round(n_jobs / elapsed, 1),
            "exactly_once_ok": len(consumed_ids) == n_jobs and set(consumed_ids) == {job_id(i) for i in range(n_jobs)},
            "done_reasons": dict(collections.Counter(r.value for n in names if (r := done_reason(n)))),
            "queue_left": [e.name for e in fileops.scan(run.queue) if e.name != ".tmp"],
            "cpu_ms_per_lifecycle": {"ps": round(ps_cpu * 1e3 / n_jobs, 3),
                                     "workers": round(workers_cpu * 1e3 / n_jobs, 3), "all": round(cpu_ms, 3)},
            "cpu_bound_ceiling_per_s": round(os.cpu_count() * 1e3 / cpu_ms, 1),
            "ps_waits": waits, "ps_waits_over_100ms": len(long_waits),
            "ps_long_waits_total_s": round(sum(long_waits), 2),
            "worker_claims_after_rescan": sum(m[2] for m in done)}


def queue_tools_ls(root: str, n_done: int, seed: int) -> dict:
    rng, run = random.Random(seed), RunDir.create(root)
    others = [ArchiveReason.PROCESSED] * 90 + [ArchiveReason.STALE] * 6 + [
        ArchiveReason.DUPLICATE, ArchiveReason.FAILED_LOAD, ArchiveReason.ORPHANED, ArchiveReason.FAILED]
    for i in range(n_done):  # job i//2: consumed, plus one other reason
        reason = ArchiveReason.CONSUMED if i % 2 == 0 else rng.choice(others)
        os.close(os.open(run.done / done_name(job_id(i // 2), reason), os.O_WRONLY | os.O_CREAT, 0o644))
    q, base = JobQueue(run), n_done // 2
    for k in range(8):
        q.put_job(job_id(base + k), job_data(k), created_step=(base + k) // 1000)
    presences = [WorkerPresence(run, dev).start() for dev in (0, 1)]
    try:
        for dev in (0, 1):  # two processing, six pending
            presences[dev].update(job_id=q.claim(dev).job_id)
        cmd = [sys.executable, "-m", "queue_tools", "ls", str(run.root), "--json"]
        walls, proc = [], None
        for _ in range(3):
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            walls.append(time.monotonic() - t0)
        floor = subprocess.run([sys.executable, "-c", "import time; t = time.monotonic(); "
                                "import asyncgrpo.jobqueue; print(time.monotonic() - t)"],
                               capture_output=True, text=True)
        result = {"command": "python " + " ".join(cmd[1:]), "returncode": proc.returncode,
                  "ran_ok": proc.returncode == 0, "wall_best_s": round(min(walls), 4),
                  "wall_median_s": round(statistics.median(walls), 4),
                  "import_asyncgrpo_jobqueue_s": round(float(floor.stdout or "nan"), 4),
                  "done_files": len(os.listdir(run.done))}
        if proc.returncode != 0:
            result["stderr_tail"] = proc.stderr.strip()[-300:]
        try:  # the same listing in this process (no interpreter start, imports done)
            from queue_tools.cli import main as ls_main
        except ImportError as err:
            result["in_process"] = {"skipped": f"queue_tools.cli not importable: {err}"}
        else:
            times = []
            for _ in range(3):
                t0 = time.monotonic()
                with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                    ls_main(["ls", str(run.root), "--json"])
                times.append(time.monotonic() - t0)
            result["in_process"] = {"call": "queue_tools.cli.main(['ls', RUN, '--json'])",
                                    "best_s": round(min(times), 4), "median_s": round(statistics.median(times), 4)}
    finally:
        for p in presences:
            p.stop()
    return result


# ------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-root", default=None, help="where run dirs go, kept (default: a temp dir, removed)")
    ap.add_argument("--handoffs", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--done-files", type=int, default=100_000)
    ap.add_argument("--quick", action="store_true", help="small counts: a smoke run in ~20 s")
    args = ap.parse_args()
    if args.quick:
        args.handoffs, args.jobs, args.done_files = 30, 200, 10_000
    root = os.path.abspath(args.run_root or tempfile.mkdtemp(prefix="queue_bench_", dir="/tmp"))
    os.makedirs(root, exist_ok=True)
    seed = 1234
    report = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0], "run_root": root},
              "args": {"handoffs": args.handoffs, "jobs": args.jobs, "done_files": args.done_files}}
    log("starting 3 worker processes")
    pool = Pool(3)
    try:
        handoff = report["handoff"] = {}
        for kind, fn in (("pending_to_worker", handoff_pending), ("complete_to_collector", handoff_complete)):
            row = handoff[kind] = {}
            for mode, events in (("event", True), ("poll_50ms", False)):
                log(f"handoff {kind} {mode} x{args.handoffs}")
                row[mode] = fn(pool, os.path.join(root, f"handoff_{kind}_{mode}"), args.handoffs, events, seed)
            row["poll_over_event_p50"] = round(row["poll_50ms"]["p50_ms"] / row["event"]["p50_ms"], 1)
            row["poll_over_event_p99"] = round(row["poll_50ms"]["p99_ms"] / row["event"]["p99_ms"], 1)
        tput = report["throughput"] = {}
        for n_workers in (1, 3):
            log(f"throughput {n_workers} worker(s) x{args.jobs} jobs")
            tput[f"{n_workers}_workers"] = throughput(pool, os.path.join(root, f"throughput_{n_workers}w"),
                                                      args.jobs, n_workers, 16, seed)
    finally:
        pool.close()
    log(f"queue_tools ls with {args.done_files} files in done/")
    ls = report["queue_tools_ls"] = queue_tools_ls(os.path.join(root, "ls_run"), args.done_files, seed)
    ev = [row["event"] for row in handoff.values()]
    owned = [handoff["pending_to_worker"]["event"]["claim_rename_done"],
             handoff["complete_to_collector"]["event"]["collect_rename_done"]]
    owned_poll = [handoff["pending_to_worker"]["poll_50ms"]["claim_rename_done"],
                  handoff["complete_to_collector"]["poll_50ms"]["collect_rename_done"]]
    report["owned_poll_over_event"] = [
        {"p50": round(p["p50_ms"] / e["p50_ms"], 1), "p99": round(p["p99_ms"] / e["p99_ms"], 1)}
        for p, e in zip(owned_poll, owned, strict=True)]
    report["goals"] = {
        "handoff_p50_le_1ms_loaded": all(r["p50_ms"] <= 1.0 for r in ev),
        "handoff_p99_le_5ms_loaded": all(r["p99_ms"] <= 5.0 for r in ev),
        "handoff_ge_20x_better_than_poll_loaded": all(
            min(row["poll_over_event_p50"], row["poll_over_event_p99"]) >= 20 for row in handoff.values()),
        "handoff_p50_le_1ms_owned": all(r["p50_ms"] <= 1.0 for r in owned),
        "handoff_p99_le_5ms_owned": all(r["p99_ms"] <= 5.0 for r in owned),
        "handoff_ge_20x_better_than_poll_owned": all(min(r.values()) >= 20 for r in report["owned_poll_over_event"]),
        "throughput_3_workers_ge_1000_per_s": tput["3_workers"]["lifecycles_per_s"] >= 1000,
        "exactly_once": all(t["exactly_once_ok"] for t in tput.values()),
        "queue_tools_ls_le_1s_with_100k": ls["ran_ok"] and ls["wall_best_s"] <= 1.0 and ls["done_files"] >= 100_000,
    }
    if not args.run_root:
        shutil.rmtree(root, ignore_errors=True)
    log("done")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
