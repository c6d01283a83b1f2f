"""Soak benchmark (not in CI): a PS and 3 workers on the demo task for 30 minutes, watched.

    .venv/bin/python bench/soak.py [--minutes 30] [--workers 3] [--interval 10] [--run-dir DIR]
                                   [--keep-files 1000] [--keep-mb 0] [--warmup 0.2] [--json PATH]

Starts the processes as launch.sh does (one CPU thread each: nproc / (workers + 1)), with
max_steps far beyond what --minutes can reach and archive retention on. Every --interval
seconds it samples each process's resident memory (VmRSS in /proc/PID/status) and open file
descriptors (/proc/PID/fd), plus done/'s payload bytes and number of files, the PS's step and
logs/' bytes, and prints one table row. At the end it stops everything (SIGTERM: the PS stops
training, each worker finishes the job in hand) and prints the growth after warm-up: the mean
of the last window (the last --warmup fraction of the run) against the mean of the first
window after warm-up (the same length, right after the first --warmup fraction). Goal: RSS
and fds of every process grow < 5%; done/'s bytes stay bounded (retention) while its number
of names keeps growing (one per archived file: the names are the ledger). Writes every sample
and the summary to --json (default RUN/soak.json). Exit status 0 when the goal is met, 1 if
not, 2 if a process died.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncgrpo.jobqueue.names import done_reason  # noqa: E402
from asyncgrpo.run import runs_dir  # noqa: E402

GOAL = 0.05
STEPS_PER_S_CEILING = 200  # max_steps = minutes * 60 * this: the PS never reaches it before the end


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--run-dir", help="default: $ASYNCGRPO_RUNS/soak-<date-time>")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--keep-files", type=int, default=1000, help="--archive_keep_files for the PS")
    p.add_argument("--keep-mb", type=float, default=0.0, help="--archive_keep_mb for the PS")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of the run that is warm-up (and window size)")
    p.add_argument("--json", help="default: RUN/soak.json")
    p.add_argument("extra", nargs="*", help="more flags for the PS and workers (after --)")
    return p.parse_args(argv)


# ------------------------------------------------------------------ sampling

def proc_rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def proc_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def dir_bytes(path: Path, grammar_only: bool = False) -> tuple[int, int, int]:
    """(bytes, files, empty files) directly in ``path``."""
    total = count = empty = 0
    try:
        with os.scandir(path) as it:
            for entry in it:
                if grammar_only and done_reason(entry.name) is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                total += st.st_size
                count += 1
                empty += st.st_size == 0
    except FileNotFoundError:
        pass
    return total, count, empty


def global_step(run: Path) -> int | None:
    try:
        return int((run / "global_step.txt").read_text().strip())
    except (OSError, ValueError):
        return None


def sample(run: Path, procs: dict[str, subprocess.Popen], t0: float) -> dict:
    done_b, done_n, empty = dir_bytes(run / "done", grammar_only=True)
    logs_b, _, _ = dir_bytes(run / "logs")
    return {
        "t_s": round(time.monotonic() - t0, 1),
        "step": global_step(run),
        "procs": {name: {"rss_kb": proc_rss_kb(p.pid), "fds": proc_fds(p.pid)} for name, p in procs.items()},
        "done_bytes": done_b,
        "done_files": done_n,
        "done_emptied": empty,
        "logs_bytes": logs_b,
    }


# ------------------------------------------------------------------ processes

def start_processes(run: Path, workers: int, common: list[str]) -> dict[str, subprocess.Popen]:
    threads = max(1, (os.cpu_count() or 1) // (workers + 1))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    logs = run / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def spawn(log_name, *args):
        out = open(logs / log_name, "ab")
        return subprocess.Popen([sys.executable, *args, *common], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)

    procs = {"ps": spawn("log_parameter_server.txt", "-m", "ps")}
    for i in range(1, workers + 1):
        procs[f"w{i}"] = spawn(f"log_worker_{i}.txt", "-m", "worker", "--device", str(i))
    return procs


def stop_processes(procs: dict[str, subprocess.Popen]) -> dict[str, int | None]:
    """SIGTERM the PS first (it stops training, releases its lock), then the workers."""
    codes = {}
    order = ["ps"] + [n for n in procs if n != "ps"]
    for name in order:
        if procs[name].poll() is None:
            procs[name].send_signal(signal.SIGTERM)
        if name == "ps":
            codes[name] = _wait(procs[name])
    for name in order[1:]:
        codes[name] = _wait(procs[name])
    return codes


def _wait(proc: subprocess.Popen, timeout: float = 120) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ------------------------------------------------------------------ report

def training_samples(samples: list[dict]) -> list[dict]:
    """The samples from the PS's first step on (start-up, model load and the first weights are not steady state)."""
    started = next((i for i, s in enumerate(samples) if s["step"] is not None), len(samples))
    return samples[started:]


def window_means(samples: list[dict], key, warmup: float) -> tuple[float | None, float | None]:
    """Mean of ``key(sample)`` over the first window after warm-up and over the last window; times
    count from the first training sample, and warm-up and each window are ``warmup`` of the span."""
    samples = training_samples(samples)
    if len(samples) < 2:
        return None, None
    start, end = samples[0]["t_s"], samples[-1]["t_s"]
    width = warmup * (end - start)
    first = [key(s) for s in samples if start + width <= s["t_s"] < start + 2 * width]
    last = [key(s) for s in samples if s["t_s"] >= end - width]
    first, last = [v for v in first if v is not None], [v for v in last if v is not None]
    if not first or not last:
        return None, None
    return statistics.fmean(first), statistics.fmean(last)


def growth_table(samples: list[dict], names: list[str], warmup: float) -> list[dict]:
    rows = []
    series = [(f"{n} rss_kb", lambda s, n=n: s["procs"][n]["rss_kb"], True) for n in names]
    series += [(f"{n} fds", lambda s, n=n: s["procs"][n]["fds"], True) for n in names]
    series += [("done/ bytes", lambda s: s["done_bytes"], False),
               ("done/ files (names: grow by design)", lambda s: s["done_files"], False),
               ("logs/ bytes", lambda s: s["logs_bytes"], False)]
    for label, key, in_goal in series:
        base, final = window_means(samples, key, warmup)
        growth = None if not base else final / base - 1
        rows.append({"series": label, "after_warmup": base, "last": final, "growth": growth, "in_goal": in_goal,
                     "ok": None if growth is None else growth < GOAL})
    return rows


def print_row(s: dict, names: list[str], header: bool = False) -> None:
    if header:
        cols = ["t_s", "step"] + [f"{n}_rss_MB {n}_fds" for n in names] + ["done_MB done_files emptied", "logs_MB"]
        print("  ".join(cols), flush=True)
    cells = [f"{s['t_s']:>5.0f}", f"{s['step'] if s['step'] is not None else '-':>5}"]
    for n in names:
        p = s["procs"][n]
        rss = f"{p['rss_kb'] / 1024:.1f}" if p["rss_kb"] is not None else "-"
        cells.append(f"{rss:>{len(n) + 7}} {p['fds'] if p['fds'] is not None else '-':>{len(n) + 4}}")
    cells.append(f"{s['done_bytes'] / 1e6:>7.2f} {s['done_files']:>10} {s['done_emptied']:>7}")
    cells.append(f"{s['logs_bytes'] / 1e6:>7.2f}")
    print("  ".join(cells), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Path(args.run_dir or runs_dir() / time.strftime("soak-%Y%m%d-%H%M%S")).expanduser().resolve()
    max_steps = min(999_000, max(2000, int(args.minutes * 60 * STEPS_PER_S_CEILING)))
    common = ["--run_dir", str(run), "--max_steps", str(max_steps), "--device_type", args.device,
              "--disable_tqdm", "true", "--archive_keep_files", str(args.keep_files),
              "--archive_keep_mb", str(args.keep_mb), *args.extra]
    print(f"soak: {args.minutes:g} min, {args.workers} workers, run {run}, max_steps {max_steps}, "
          f"retention keep_files={args.keep_files} keep_mb={args.keep_mb:g}, sample every {args.interval:g}s",
          flush=True)
    procs = start_processes(run, args.workers, common)
    names = list(procs)
    samples: list[dict] = []
    died = None
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    try:
        while True:
            s = sample(run, procs, t0)
            samples.append(s)
            print_row(s, names, header=len(samples) == 1)
            died = [n for n, p in procs.items() if p.poll() is not None]
            if died or time.monotonic() >= deadline:
                break
            time.sleep(max(0.0, min(args.interval, deadline - time.monotonic())))
    except KeyboardInterrupt:
        print("soak: interrupted; stopping the processes", flush=True)
    finally:
        codes = stop_processes(procs)
    rows = growth_table(samples, names, args.warmup)
    print(f"\ngrowth, from the first training step on: mean of the last {args.warmup:.0%} vs the {args.warmup:.0%} "
          f"right after the first {args.warmup:.0%} (warm-up); goal < {GOAL:.0%} for every process's RSS and fds")
    for r in rows:
        if r["growth"] is None:
            print(f"  {r['series']:<40} (not enough samples)")
            continue
        mark = ("ok" if r["ok"] else "OVER") if r["in_goal"] else "info"
        print(f"  {r['series']:<40} {r['after_warmup']:>14.1f} -> {r['last']:>14.1f}  {r['growth']:+7.1%}  {mark}")
    goal_rows = [r for r in rows if r["in_goal"]]
    met = bool(goal_rows) and all(r["ok"] for r in goal_rows)
    done_max = max((s["done_bytes"] for s in samples), default=0)
    last = samples[-1] if samples else {"done_files": 0, "done_emptied": 0}
    print(f"done/: at most {done_max / 1e6:.2f} MB of payloads at any sample; {last['done_files']} names, "
          f"{last['done_emptied']} emptied by retention")
    print(f"exit codes after SIGTERM: {codes}" + (f"; died during the soak: {died}" if died else ""))
    verdict = "died" if died else ("met" if met else "NOT met")
    print(f"goal (< {GOAL:.0%} RSS and fd growth after warm-up): {verdict}")
    out = Path(args.json) if args.json else run / "soak.json"
    out.write_text(json.dumps({"args": vars(args), "run_dir": str(run), "max_steps": max_steps,
                               "samples": samples, "growth": rows, "done_max_bytes": done_max,
                               "exit_codes": codes, "died": died, "goal_met": met}, indent=1))
    print(f"samples and summary: {out}")
    return 2 if died else (0 if met else 1)


if __name__ == "__main__":
    sys.exit(main())
