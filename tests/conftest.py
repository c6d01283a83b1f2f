"""Shared fixtures: a fresh run directory and a queue over it, in pytest's tmp_path; one
real 8-step demo run (a PS and two workers) that several tests read."""

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.jobqueue import JobQueue, RunDir


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir.create(tmp_path / "run")


@pytest.fixture
def queue(run) -> JobQueue:
    return JobQueue(run)


@pytest.fixture(autouse=True)
def _queue_logs_visible(caplog):
    caplog.set_level(logging.INFO, logger="asyncgrpo")


# Tests send Ctrl-C (SIGINT) to processes they start. Started from a background shell job
# (nohup ... &), pytest inherits SIGINT ignored, and an ignored signal stays ignored across
# exec in every child: give the children the default disposition back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]
PROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
DEMO_RUN_FLAGS = ["--max_steps", "8", "--lease_s", "4", "--save_strategy", "steps", "--save_steps", "3",
                  "--seed", "0"]


@pytest.fixture(scope="session")
def finished_demo_run(tmp_path_factory) -> Path:
    """The run directory of a real PS + 2 workers run of 8 steps, finished and stopped (workers
    exit 0 on SIGTERM). Started once per test run; tests only read it (the report adds report/).
    The processes' output is in the parent folder: ps.log, w1.log, w2.log."""
    root = tmp_path_factory.mktemp("demo8") / "run"

    def start(name, *args):
        with open(root.parent / f"{name}.log", "ab") as log:
            return subprocess.Popen([sys.executable, "-m", *args, "--run_dir", str(root), *DEMO_RUN_FLAGS],
                                    cwd=REPO, env=PROCESS_ENV, stdout=log, stderr=subprocess.STDOUT)

    ps = start("ps", "ps")
    workers = [start(f"w{i}", "worker", "--device", str(i)) for i in (1, 2)]
    try:
        assert ps.wait(timeout=600) == 0, (root.parent / "ps.log").read_text()[-3000:]
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        codes = [worker.wait(timeout=120) for worker in workers]
    assert codes == [0, 0], codes
    return root
