"""A worker that generates several jobs in one call (--jobs_per_generate) and is killed holding them: every
one comes back through recovery and is trained exactly once, by another worker.

The second worker starts only once the PS has put all three back in pending (attempt 2). Started earlier, it
would claim the jobs behind them and the run could train its 6 steps before recovery noticed the kill (the jobs
then archived ``unused``, correctly: training had ended): which jobs trained would depend on timing. Claims are
FIFO by job id, so the recovered jobs, the oldest, are generated first and must be trained."""

from __future__ import annotations

import json
import os

from helpers import PROCESS_ENV, assert_exactly_once, demo_flags, run_flags, start_process, wait_for

# The demo task with another reward.
FLAGS = [*demo_flags(), *run_flags(6, save_steps=3), "--disable_tqdm", "true", "--jobs_per_generate", "3",
         "--reward_funcs", "tests.reward_faults:hangs_where_told"]
TIMEOUT_S = 300


def in_queue(root, part: str) -> list[str]:
    return sorted(name for name in os.listdir(root / "queue") if part in name)


def test_a_worker_killed_holding_three_jobs_loses_and_repeats_none(tmp_path):
    root, marker = tmp_path / "run", tmp_path / "hanging"
    ps = start_process(root, tmp_path / "ps.log", "ps", *FLAGS)
    stuck = second = None
    try:
        wait_for(lambda: (root / "queue").is_dir() and len(in_queue(root, "_pending")) >= 3, "3 pending jobs",
                 TIMEOUT_S, procs=(ps,))
        stuck = start_process(root, tmp_path / "w1.log", "worker", "--device", "1", *FLAGS,
                              env={**PROCESS_ENV, "ASYNCGRPO_TEST_HANG": str(marker)})
        wait_for(marker.exists, "the first worker to score", TIMEOUT_S, procs=(ps, stuck))
        held = [name.split("_processing")[0] for name in in_queue(root, "_processing_by_dev1")]
        assert len(held) == 3, os.listdir(root / "queue")
        heartbeat = root / "workers" / "dev1.json"
        wait_for(lambda: len(json.loads(heartbeat.read_text()).get("job_ids") or []) == 3, "the heartbeat", TIMEOUT_S,
                 procs=(stuck,))
        assert sorted(json.loads(heartbeat.read_text())["job_ids"]) == held
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
