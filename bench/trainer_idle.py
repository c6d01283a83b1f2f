"""Trainer idle fraction on the demo task with 1, 2 and 3 workers (real PS and worker processes).

    .venv/bin/python bench/trainer_idle.py [--steps 200] [--workers 1 2 3]

For each worker count: a fresh run directory, the PS and N workers started as launch.sh
starts them (one thread each on CPU), trained for --steps steps. From RUN/metrics.jsonl:
trainer idle fraction = sum(trainer_wait_s) / (time of the last step - time of the first),
steps/s, mean and max staleness, final 20-step mean reward. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncgrpo.run import RunDir, metrics

REPO = Path(__file__).resolve().parents[1]


def run_once(root: Path, workers: int, steps: int) -> dict:
    threads = max(1, (os.cpu_count() or 1) // (workers + 1))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    common = ["--run_dir", str(root), "--max_steps", str(steps), "--seed", "0", "--disable_tqdm", "true"]
    logs = open(root.parent / f"{root.name}.log", "wb")
    started = time.time()
    ps = subprocess.Popen([sys.executable, "-m", "ps", *common], cwd=REPO, env=env, stdout=logs, stderr=logs)
    procs = [subprocess.Popen([sys.executable, "-m", "worker", "--device", str(i), *common], cwd=REPO, env=env,
                              stdout=logs, stderr=logs) for i in range(1, workers + 1)]
    try:
        if ps.wait(timeout=1800) != 0:
            raise RuntimeError(f"PS failed; see {logs.name}")
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=120)
    wall = time.time() - started
    lines = metrics.read_lines(RunDir(root).metrics_file)
    training_s = lines[-1]["time"] - lines[0]["time"]
    waited = sum(m["trainer_wait_s"] for m in lines[1:])  # the first step also waits for start-up
    return {
        "workers": workers,
        "steps": len(lines),
        "wall_s_process_start_to_exit": round(wall, 1),
        "training_s_first_to_last_step": round(training_s, 2),
        "steps_per_s": round((len(lines) - 1) / training_s, 2),
        "trainer_idle_fraction": round(waited / training_s, 3),
        "first_step_wait_s": round(lines[0]["trainer_wait_s"], 2),
        "staleness_mean": round(sum(m["staleness_mean"] for m in lines) / len(lines), 2),
        "staleness_max": max(m["staleness_max"] for m in lines),
        "final_reward_20": round(sum(m["reward"] for m in lines[-20:]) / 20, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="trainer_idle_"))
    try:
        runs = [run_once(base / f"w{n}", n, args.steps) for n in args.workers]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                      "steps": args.steps, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
