"""A job that never ends does not stall the run (--job_timeout_s: worker/deadline.py, and recovery's backstop).
Real processes, real reward functions that never return (tests/processes/reward_faults.py).

Without a deadline both runs below stall for good: the worker holding the job beats, so its lease never expires,
and the trainer, taking results in job order, waits for that job."""

from __future__ import annotations

import re

from helpers import (
    PROCESS_ENV,
    REPO,
    assert_exactly_once,
    demo_flags,
    expect_exit,
    launch_sh,
    metrics,
    pid_alive,
    run_flags,
    start_faulty_worker,
    start_process,
    wait_for,
)

from asyncgrpo.run import fileops

TIMEOUT_S = 420
JOB_TIMEOUT_S = 4  # a demo job takes about 0.1 s


def failed_jobs(run_root) -> dict[str, dict]:
    """{job id: its failure report (the errors of its attempts, the job)} of the jobs archived failed."""
    return {path.name[:10]: fileops.load_payload(path)["data"]
            for path in (run_root / "done").iterdir() if "_failed" in path.name}


def test_a_reward_that_never_returns_on_one_prompt_in_ten_does_not_stall_the_run(tmp_path):
    """3 workers, two jobs a generate call; the trainer takes results in job order, so each job holding "7:" must
    end before the jobs after it train: each of its two attempts runs to the deadline, the worker fails it naming
    the reward function, gives its other job back and is restarted; then the job is reported failed, and the run
    trains its steps."""
    run_root, steps = tmp_path / "run", 2
    flags = [*demo_flags(), *run_flags(steps, save_steps=100),
             "--reward_funcs", "tests.processes.reward_faults:hangs_on_prompt_7", "--job_timeout_s", str(JOB_TIMEOUT_S),
             "--max_attempts", "2", "--jobs_per_generate", "2", "--consume_order", "fifo", "--disable_tqdm", "true"]
    done = launch_sh(REPO, "--run-dir", str(run_root), "--workers", "3", *flags, timeout=TIMEOUT_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert [m["step"] for m in metrics(run_root)] == list(range(1, steps + 1))
    failed = failed_jobs(run_root)
    assert failed, "no job hung"
    for job_id, report in failed.items():
        assert "7:" in {row["prompt"] for row in report["job"]["rows"]}, job_id
        assert [e["attempt"] for e in report["errors"]] == [1, 2], (job_id, report["errors"])
        for error in report["errors"]:
            assert error["type"] == "JobTimeout" and error["reward_function"] == "hangs_on_prompt_7", error
            assert re.fullmatch(rf"the job ran past its deadline \(--job_timeout_s {JOB_TIMEOUT_S}: held \d+ s\), "
                                r"stuck in reward function 'hangs_on_prompt_7'", error["message"]), error
    restarts = re.findall(r"worker (\d) \(pid \d+\) exited with status 4, a job ran past --job_timeout_s: "
                          r"restarting it", out)
    assert len(restarts) >= 2, out[-4000:]
    logs = "".join(p.read_text() for p in (run_root / "logs").glob("log_worker_*.txt"))
    assert "Every thread's stack follows." in logs and "Thread 0x" in logs  # where it was stuck, in its log
    assert_exactly_once(run_root, jobs=steps)


def test_a_job_whose_worker_cannot_act_on_its_deadline_is_taken_back_by_recovery(tmp_path):
    """The backstop: the first worker's reward never returns and its deadline cannot act (it blocks, as behind a
    lock the stuck thread holds); the worker lives and beats. The PS's recovery takes the job back once held past
    the deadline and the lease, the second worker trains it, and the run (results in job order) completes."""
    run_root, steps = tmp_path / "run", 3
    flags = [*demo_flags(), *run_flags(steps, save_steps=100), "--job_timeout_s", str(JOB_TIMEOUT_S),
             "--jobs_per_generate", "1", "--consume_order", "fifo", "--disable_tqdm", "true",
             "--reward_funcs", "tests.processes.reward_faults:hangs_where_told"]
    marker = tmp_path / "hanging"
    ps = start_process(run_root, tmp_path / "ps.log", "ps", *flags)
    stuck = second = None
    try:
        stuck = start_faulty_worker(run_root, tmp_path / "w1.log", "deadline-cannot-act", "--device", "1", *flags,
                                    extra_env={"ASYNCGRPO_TEST_HANG": str(marker)})
        wait_for(marker.exists, "the first worker to hang in its reward function", TIMEOUT_S, procs=(ps, stuck))
        second = start_process(run_root, tmp_path / "w2.log", "worker", "--device", "2", *flags, env=PROCESS_ENV)
        expect_exit(ps, 0, tmp_path / "ps.log", TIMEOUT_S)
        assert pid_alive(stuck.pid)  # alive all along, beating
    finally:
        for proc in (ps, stuck, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    ps_log = (tmp_path / "ps.log").read_text()
    assert re.search(r"recover: requeue 000000_000_processing_by_dev1\.pt -> 000000_000_pending_a2\.pt: worker dev1 "
                     rf"has held it \d+s, past its deadline \(--job_timeout_s {JOB_TIMEOUT_S}\) and the lease",
                     ps_log), ps_log[-3000:]
    trained = assert_exactly_once(run_root, jobs=steps)
    assert "000000_000" in trained
