"""Racing plain TRL and asyncgrpo to a reward target on a built-in task (bench/dynamic_sampling.py,
bench/tool_latency.py): when a run has reached the target (a rolling mean of its steps' rewards), each side run as
real processes until its stop condition, and the command line and JSON document the races share.

A race's script runs TRL in a child of itself (``--trl-child SPEC``, common.py run_trl_child); its asyncgrpo side is
``python -m ps`` and N ``python -m worker`` on one run directory, with OpenMP threads as launch.sh gives them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from common import (
    read_trl_steps,
    ready_to_train_at,
    remove_weight_buffers,
    run_trl_child,
    start_python,
    terminate_and_reap,
    train_trl_child,
)

from asyncgrpo.run import RunDir, metrics

WINDOW = 10  # steps the rolling reward is the mean of


def rolling(rewards: list[float]) -> list[float]:
    return [statistics.fmean(rewards[max(0, i - WINDOW + 1):i + 1]) for i in range(len(rewards))]


def reached(rewards: list[float], target: float) -> int | None:
    """The first step (1-based) whose rolling mean over a full window reaches ``target``."""
    return next((i + 1 for i, r in enumerate(rolling(rewards)) if i + 1 >= WINDOW and r >= target), None)


def launch_threads(workers: int) -> int:
    """The OpenMP threads launch.sh gives each of a CPU run's processes (the PS and ``workers`` workers)."""
    return max(1, (os.cpu_count() or 1) // (workers + 1))


# ----------------------------------------------------------------------------- TRL's side

def run_trl(script: str, spec: dict, work: Path, env: dict, timeout_s: float
            ) -> tuple[int, float | None, list[dict]]:
    """Plain TRL in a child of ``script`` with ``spec`` (its "config" and stop condition; the log and temporary
    folder are added here): its return code, when its trainer was ready (None: never), and its step lines
    ({"t", "step", "reward"})."""
    work.mkdir(parents=True)
    spec = {**spec, "log": str(work / "steps.jsonl"), "tmp": str(work)}
    proc, _cpu = run_trl_child(script, spec, work, env, timeout_s)
    ready, steps = read_trl_steps(work / "steps.jsonl")
    return proc.returncode, ready, steps


def child_spec(spec_path: str) -> dict:
    """In the TRL child, before its heavy imports: the spec ``run_trl`` wrote, TRL's warnings silenced."""
    warnings.filterwarnings("ignore")
    return json.loads(Path(spec_path).read_text())


def train_trl(spec: dict, write_model: Callable[[str], str], reward, build_dataset,
              should_stop: Callable[[list[float], int], bool], **trainer_kwargs) -> int:
    """In the TRL child: the task's model (``write_model(folder)``), reward and dataset (``build_dataset(n, seed)``)
    trained with spec['config'] until ``should_stop(rewards, step)``; its exit status."""
    work = tempfile.mkdtemp(prefix="trl_", dir=spec["tmp"])
    train_trl_child(spec, work, write_model(os.path.join(work, "model")), reward,
                    build_dataset(n=1000, seed=spec["config"]["seed"]), should_stop, **trainer_kwargs)
    shutil.rmtree(work, ignore_errors=True)
    return 0


# ----------------------------------------------------------------------------- asyncgrpo's side

def run_asyncgrpo(run: Path, flags: list[str], env: dict, workers: int, should_stop: Callable[[list[float]], bool],
              timeout_s: float, reap_s: float, ps_flags: tuple[str, ...] = ()) -> tuple[int, list[dict], float | None]:
    """The PS (with ``ps_flags`` too) and ``workers`` workers on ``run``, every process with ``flags``, until
    ``should_stop(rewards)``, the PS's end or ``timeout_s``; then stopped (the PS first: workers then finish the job
    in hand and exit, within ``reap_s``). The PS's exit status (0 where it was stopped), the run's metrics lines,
    and when training could start (the PS ready and every worker holding its first weights; None: never)."""
    (run / "logs").mkdir(parents=True)

    def start(name, *cmd):
        return start_python(run / "logs" / name, "-m", *cmd, *flags, env=env)

    ps = start("ps.txt", "ps", *ps_flags)
    procs = [ps] + [start(f"worker{i}.txt", "worker", "--device", str(i)) for i in range(1, workers + 1)]
    metrics_file = RunDir(run).metrics_file
    deadline = time.monotonic() + timeout_s
    try:
        while ps.poll() is None and time.monotonic() < deadline:
            if should_stop([s["reward"] for s in metrics.read_lines(metrics_file)]):
                break
            time.sleep(0.2)
    finally:
        terminate_and_reap(procs, reap_s)
    remove_weight_buffers(run)
    status = 0 if ps.returncode in (0, 130, -15) else ps.returncode
    return status, metrics.read_lines(metrics_file), ready_to_train_at(run, workers)


# ----------------------------------------------------------------------------- the command line and the document

def argument_parser(description: str, configs: dict, cap: int) -> argparse.ArgumentParser:
    """The flags every race takes: --seeds, --configs (of ``configs``), --target, --cap, --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--configs", default=",".join(configs))
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--cap", type=int, default=cap)
    parser.add_argument("--out")
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None, configs: dict) -> argparse.Namespace:
    """``argv`` parsed, its --seeds and --configs as lists (an unknown config refused)."""
    args = parser.parse_args(argv)
    args.seeds, args.configs = [int(s) for s in args.seeds.split(",")], args.configs.split(",")
    unknown = [c for c in args.configs if c not in configs]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(configs)}")
    return args


def report(text: str, doc: dict, out: str | None) -> None:
    """The table, then the JSON document (with the machine it ran on) to stdout, and the document to ``out``."""
    doc = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
           **doc}
    print(text)
    print(json.dumps(doc))
    if out:
        Path(out).write_text(json.dumps(doc, indent=1))

