"""In-flight weight updates through real processes: a worker SIGKILLed inside a weight sync between decoding steps
(tests/processes/faulty_worker.py) loses the jobs it was generating, and only those: recovery gives them back, another
worker generates them, and every job is trained exactly once."""

import re
import signal

from helpers import (
    assert_exactly_once,
    expect_exit,
    log_tail,
    metrics,
    run_flags,
    start_faulty_worker,
    start_process,
    wait_for,
)

TIMEOUT_S = 300
STEPS = 60


def test_a_worker_killed_inside_an_in_flight_sync_loses_only_the_jobs_it_held(tmp_path):
    root = tmp_path / "run"
    flags = [*run_flags(STEPS, save_steps=1000), "--in_flight_updates"]
    ps = start_process(root, tmp_path / "ps.log", "ps", *flags)
    dying = start_faulty_worker(root, tmp_path / "w1.log", "kill-mid-sync-in-job", "--device", "1", *flags)
    other = start_process(root, tmp_path / "w2.log", "worker", "--device", "2", *flags)
    try:
        wait_for(lambda: dying.poll() is not None, "dev1 to die inside an in-flight sync", TIMEOUT_S,
                 procs=(ps, other))
        assert dying.returncode == -signal.SIGKILL, log_tail(tmp_path / "w1.log")
        held = {n.name.split("_processing_by_dev1")[0] for n in (root / "queue").iterdir()
                if "_processing_by_dev1" in n.name}
        expect_exit(ps, 0, tmp_path / "ps.log", TIMEOUT_S)
        # Those the PS recovered before the listing above saw them (it looks for dead workers every lease_s / 4).
        held |= set(re.findall(r"recover: requeue (\d+_\d+)_processing_by_dev1\.pt -> \S+: worker dev1 is dead",
                               (tmp_path / "ps.log").read_text()))
        # The jobs of the generate call it was in (--jobs_per_generate, default 2: one or two were pending).
        assert 1 <= len(held) <= 2, held
    finally:
        for proc in (dying, other, ps):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=120)
    assert [m["step"] for m in metrics(root)] == list(range(1, STEPS + 1))
    assert_exactly_once(root, jobs=STEPS)  # the held job among them, trained once
    done = [p.name for p in (root / "done").iterdir()]
    # Recovered as a dead worker's jobs (attempt 2, not a failure: nothing "retried"), generated and trained.
    for job_id in held:
        assert {f"{job_id}_processed_a2.pt", f"{job_id}_consumed.pt"} <= set(done), sorted(done)
        assert f"{job_id}_retried.pt" not in done
