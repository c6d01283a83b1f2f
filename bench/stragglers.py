"""A straggler against the trainer: the demo with 3 workers under launch.sh; one worker is stopped (SIGSTOP)
while it holds a job, for --stop-s seconds (longer than a lease would tolerate: --lease_s is set above it),
then continued. Prints the trainer's longest wait for a result during the stop, the typical job time, and the
steps trained during the stop.

    python bench/stragglers.py [--stop-s 60] [--max-steps 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncgrpo.events import read_events  # noqa: E402
from asyncgrpo.run import RunDir, metrics  # noqa: E402


def step(run: Path) -> int:
    last = metrics.last_line(RunDir(run).metrics_file)
    return last["step"] if last else 0


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"stragglers: gave up waiting for {what}")
        time.sleep(0.05)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stop-s", type=float, default=60.0)
    ap.add_argument("--max-steps", type=int, default=3000)
    args = ap.parse_args()
    run = Path(tempfile.mkdtemp(prefix="stragglers-")) / "run"
    launcher = subprocess.Popen(["bash", str(REPO / "launch.sh"), "--workers", "3", "--run-dir", str(run),
                                 "--max-steps", str(args.max_steps), "--lease_s", str(args.stop_s * 2),
                                 "--save_strategy", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        wait_for(lambda: step(run) >= 100, "100 steps", launcher)
        worker = json.loads((run / "workers" / "dev2.json").read_text())["pid"]
        while True:  # stop it at a moment it holds a job
            wait_for(lambda: any("_by_dev2" in n for n in os.listdir(run / "queue")), "dev2 holding a job", launcher)
            os.kill(worker, signal.SIGSTOP)
            if any("_by_dev2" in n for n in os.listdir(run / "queue")):
                break
            os.kill(worker, signal.SIGCONT)
        first = step(run)
        time.sleep(args.stop_s)  # the fault: a stopped worker
        last = step(run)
        os.kill(worker, signal.SIGCONT)
        wait_for(lambda: launcher.poll() is not None, "the end of training", launcher, timeout=1800)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGINT)
            launcher.wait()
    waits = {e["step"]: e["dur_ms"] for e in read_events(run, process="ps", event="wait_result")}
    during = [waits[s] for s in range(first + 1, last + 1) if s in waits]
    job_ms = [e["dur_ms"] for e in read_events(run, role="worker", event="result_written")]
    print(f"worker dev2 stopped {args.stop_s:g} s holding a job; steps trained meanwhile: {last - first}")
    print(f"trainer's longest wait for a result during the stop: {max(during):.0f} ms "
          f"(median wait then {statistics.median(during):.0f} ms)")
    print(f"typical job (median result_written dur_ms over the run): {statistics.median(job_ms):.0f} ms")
    print(f"straggler warnings in the PS log: "
          f"{(run / 'logs' / 'log_parameter_server.txt').read_text().count('a straggler')}")


if __name__ == "__main__":
    main()
