"""What timeline events cost, as a fraction of a demo step.

    .venv/bin/python bench/events_overhead.py [RUN_DIR]

Measures the cost of one ``EventLog.emit`` (JSON encoding plus one O_APPEND write to a
real file, the same fields a worker writes), then, from a finished run (default: the
newest under the runs folder), counts the events each process wrote per train step or
per job and divides by that run's median step or job time. Goal: <= 1%.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncgrpo.events import EventLog, read_events  # noqa: E402
from asyncgrpo.run import RunDir, RunDirError, latest_run, metrics  # noqa: E402

EMITS = 20_000


def emit_cost_us() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        events = EventLog(tmp, "bench", "worker", "cpu")
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for i in range(EMITS):
                events.emit("generate_end", job_id="000123_004", weights_version=i, dur_ms=12.5)
            best = min(best, (time.perf_counter() - started) / EMITS * 1e6)
        events.close()
    return best


def main() -> int:
    try:
        run = Path(sys.argv[1]) if len(sys.argv) > 1 else latest_run().root
    except RunDirError as err:
        print(f"events_overhead: error: {err}", file=sys.stderr)
        return 2
    metrics_file = RunDir(run).metrics_file
    if not metrics_file.is_file():
        print("events_overhead: error: give a finished run directory (bash launch.sh --workers 3 makes one)",
              file=sys.stderr)
        return 2
    cost_us = emit_cost_us()
    print(f"one emit: {cost_us:.1f} us (best of 5 x {EMITS})")
    steps = metrics.read_lines(metrics_file)
    step_s = statistics.median(s["step_time_s"] for s in steps)
    print(f"run {run}: {len(steps)} steps, median step {step_s * 1e3:.1f} ms")
    by_process: dict[str, list[dict]] = {}
    for record in read_events(run):
        by_process.setdefault(record["process"], []).append(record)
    for process, records in by_process.items():
        counts = Counter(r["event"] for r in records)
        if records and records[0]["role"] == "ps":
            per_unit, unit_s, unit = sum(counts.values()) / max(1, counts["train_step_end"]), step_s, "step"
        else:
            jobs = [r["dur_ms"] / 1e3 for r in records if r["event"] == "result_written"]
            if not jobs:
                continue
            per_unit, unit_s, unit = sum(counts.values()) / len(jobs), statistics.median(jobs), "job"
        overhead = per_unit * cost_us / 1e6 / unit_s
        print(f"{process:>14}: {per_unit:.1f} events per {unit} of {unit_s * 1e3:.1f} ms "
              f"-> overhead {overhead:.3%} (goal <= 1%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
