"""A worker decoding with continuous batching (--worker_decoding continuous) and killed holding several jobs (in its
slots and waiting to be scored): every one comes back through recovery and is trained exactly once, by another
worker.

The first worker's reward function hangs (tests/reward_faults.py): its first finished job never gets scored, the
jobs behind it finish decoding and wait, and the worker stops claiming once as many jobs wait as its slots hold.
The second worker starts only once the PS has put them all back in pending (attempt 2): claims are FIFO by job id,
so the recovered jobs are generated first and must be trained.
"""

from __future__ import annotations

import json
import os

from helpers import PROCESS_ENV, assert_exactly_once, demo_flags, run_flags, start_process, wait_for

FLAGS = [*demo_flags(), *run_flags(6, save_steps=3), "--disable_tqdm", "true", "--worker_decoding", "continuous",
         "--reward_funcs", "tests.reward_faults:hangs_where_told"]
TIMEOUT_S = 300


def in_queue(root, part: str) -> list[str]:
    return sorted(name for name in os.listdir(root / "queue") if part in name)


def test_a_continuous_worker_killed_holding_several_jobs_loses_and_repeats_none(tmp_path):
    root, marker = tmp_path / "run", tmp_path / "hanging"
    ps = start_process(root, tmp_path / "ps.log", "ps", *FLAGS)
    stuck = second = None
    try:
        stuck = start_process(root, tmp_path / "w1.log", "worker", "--device", "1", *FLAGS,
                              env={**PROCESS_ENV, "ASYNCGRPO_TEST_HANG": str(marker)})
        wait_for(marker.exists, "the first worker to score", TIMEOUT_S, procs=(ps, stuck))
        heartbeat = root / "workers" / "dev1.json"

        def holds_what_its_heartbeat_says():  # (the engine finishes the jobs in its slots, then claims no more)
            held = in_queue(root, "_processing_by_dev1")
            job_ids = json.loads(heartbeat.read_text()).get("job_ids") or []
            return len(held) >= 2 and sorted(job_ids) == [name.split("_processing")[0] for name in held]

        wait_for(holds_what_its_heartbeat_says, "the heartbeat to name every job held", TIMEOUT_S, procs=(stuck,))
        held = [name.split("_processing")[0] for name in in_queue(root, "_processing_by_dev1")]
        stuck.kill()
        stuck.wait(timeout=60)
        requeued = [f"{job}_pending_a2.pt" for job in held]
        wait_for(lambda: set(requeued) <= set(in_queue(root, "_pending_a2")), "the held jobs back in pending",
                 TIMEOUT_S, procs=(ps,))
        second = start_process(root, tmp_path / "w2.log", "worker", "--device", "2", *FLAGS)
        assert ps.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "ps.log").read_text()[-3000:]
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
    log = (tmp_path / "w2.log").read_text()
    assert "compiling its decoding step (continuous" in log and "jobs_in_call" not in log
