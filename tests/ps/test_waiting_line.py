"""What the terminal says while the trainer waits: the PS's waiting line names what the workers are doing (their
heartbeats), and launch.sh's terminal filter lets through a worker compiling its decoding step (a minute on a CPU,
said only in its log before)."""

import re
import subprocess

import pytest
from helpers import REPO

from asyncgrpo.run import WorkerPresence
from ps.pipeline import workers_line


def test_the_waiting_line_says_what_the_workers_are_doing(run):
    assert workers_line(run, 30.0) == ""
    compiling, busy, loading = (WorkerPresence(run, i).start() for i in (1, 2, 3))
    try:
        compiling.update(state="compiling")
        busy.update(state="busy")
        for presence in (compiling, busy):
            presence.beat()
        # (a worker just started loads its model: not idle, as the line said before it had claimed anything)
        assert workers_line(run, 30.0) == "; workers: 1 busy, 1 compiling, 1 starting"
    finally:
        for presence in (compiling, busy, loading):
            presence.stop()


@pytest.mark.process
def test_the_terminal_shows_a_worker_compiling_and_a_job_past_its_deadline():
    pattern = re.search(r"grep --line-buffered -E '([^']+)'", (REPO / "launch.sh").read_text())[1]
    lines = [
        "2026-11-27 14:30:00,000 worker1 INFO [gen] dev1 decodes with TRL's generate (--worker_decoding auto), not "
        "continuous batching: a model of 70,976 parameters, whose decoding step on a CPU costs less than the engine's "
        "own bookkeeping (the engine pays from 1,000,000)",
        "2026-11-27 14:30:01,000 worker1 INFO [gen] dev1 compiling its decoding step (graph, batch 64 rows, cache 48 "
        "tokens) before its first job",
        "2026-11-27 14:30:20,000 worker1 INFO [gen] dev1 decoding compiled in 19.0 s (graph)",
        "2026-11-27 14:30:20,000 worker2 ERROR [gen] dev2 graph decoding failed to compile (CalledProcessError: ...); "
        "decoding eagerly",
        "2026-11-27 14:30:59,000 worker1 ERROR [jobs] dev1 job=000000_002 attempt 1/3: the job ran past its deadline "
        "(--job_timeout_s 30: held 30 s), stuck in reward function 'score'; thrown again as attempt 2",
        "2026-11-27 14:31:00,000 worker1 INFO [gen] dev1 job=000000_003 weights_version=3 dur_ms=120 reward=0.5",
    ]
    shown = subprocess.run(["grep", "-E", pattern], input="\n".join(lines) + "\n", capture_output=True,
                           text=True).stdout.splitlines()
    assert shown == lines[:5]
