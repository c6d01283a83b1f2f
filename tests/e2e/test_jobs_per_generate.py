"""A worker killed holding several jobs loses and repeats none: every one comes back through recovery and is trained
exactly once, by another worker. Two ways to hold several: three jobs generated in one call (--jobs_per_generate),
and continuous batching (--worker_decoding continuous), with jobs in its slots and finished ones waiting to be
scored.

The first worker's reward function hangs (tests/processes/reward_faults.py): its first job never gets scored (with
continuous batching the jobs behind it finish decoding and wait, and the worker claims no more once as many wait as its
slots hold). The second worker starts only once the PS has put them all back in pending (attempt 2). Started earlier, it
would claim the jobs behind them and the run could train its 6 steps before recovery noticed the kill (the jobs
then archived ``unused``, correctly: training had ended): which jobs trained would depend on timing. Claims are
FIFO by job id, so the recovered jobs, the oldest, are generated first and must be trained."""

from __future__ import annotations

import json
import os

import pytest
from helpers import PROCESS_ENV, assert_exactly_once, demo_flags, expect_exit, run_flags, start_process, wait_for

# The demo task with another reward.
FLAGS = [*demo_flags(), *run_flags(6, save_steps=3), "--disable_tqdm", "true",
         "--reward_funcs", "tests.processes.reward_faults:hangs_where_told"]
TIMEOUT_S = 300
MODES = {"three_jobs_a_call": (["--jobs_per_generate", "3"], 3),  # (flags, the fewest jobs the worker holds)
         "continuous": (["--worker_decoding", "continuous"], 2)}


def in_queue(root, part: str) -> list[str]:
    return sorted(name for name in os.listdir(root / "queue") if part in name)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_worker_killed_holding_several_jobs_loses_and_repeats_none(tmp_path, mode):
    mode_flags, fewest = MODES[mode]
    flags = [*FLAGS, *mode_flags]
    root, marker = tmp_path / "run", tmp_path / "hanging"
    ps = start_process(root, tmp_path / "ps.log", "ps", *flags)
    stuck = second = None
    try:
        wait_for(lambda: (root / "queue").is_dir() and len(in_queue(root, "_pending")) >= 3, "3 pending jobs",
                 TIMEOUT_S, procs=(ps,))
        stuck = start_process(root, tmp_path / "w1.log", "worker", "--device", "1", *flags,
                              env={**PROCESS_ENV, "ASYNCGRPO_TEST_HANG": str(marker)})
        wait_for(marker.exists, "the first worker to score", TIMEOUT_S, procs=(ps, stuck))
        heartbeat = root / "workers" / "dev1.json"

        def holds_what_its_heartbeat_says():  # (a continuous worker finishes the jobs in its slots, then stops)
            held = in_queue(root, "_processing_by_dev1")
            job_ids = json.loads(heartbeat.read_text()).get("job_ids") or []
            return len(held) >= fewest and sorted(job_ids) == [name.split("_processing")[0] for name in held]

        wait_for(holds_what_its_heartbeat_says, "the heartbeat to name every job held", TIMEOUT_S, procs=(stuck,))
        held = [name.split("_processing")[0] for name in in_queue(root, "_processing_by_dev1")]
        if mode == "three_jobs_a_call":
            assert len(held) == 3, held  # one call's jobs, no more
        stuck.kill()
        stuck.wait(timeout=60)
        requeued = [f"{job}_pending_a2.pt" for job in held]
        wait_for(lambda: set(requeued) <= set(in_queue(root, "_pending_a2")), "the held jobs back in pending",
                 TIMEOUT_S, procs=(ps,))
        second = start_process(root, tmp_path / "w2.log", "worker", "--device", "2", *flags)
        expect_exit(ps, 0, tmp_path / "ps.log", TIMEOUT_S)
    finally:
        for proc in (ps, stuck, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    trained = assert_exactly_once(root, 6)
    assert set(held) <= set(trained)  # the jobs the killed worker held came back and were trained
    done = os.listdir(root / "done")
    for job in held:  # ... generated on their second attempt, by the second worker
        assert f"{job}_processed_a2.pt" in done and f"{job}_processed.pt" not in done, sorted(done)
    if mode == "continuous":
        assert "compiling its decoding step (continuous" in (tmp_path / "w2.log").read_text()
