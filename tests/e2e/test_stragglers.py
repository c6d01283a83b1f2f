"""A straggler never stalls training. Three workers, real processes: one has a reward call that hangs (alive but
slow), then another is stopped (SIGSTOP) while it holds a job; each fault lasts until the trainer has trained
MIN_STEPS_IN_FAULT steps on the other workers' results beside it (however fast the machine is). `queue_tools ls`
names the stopped worker, and no job is lost or trained twice. The lease (60 s) is far longer than the faults:
without straggler handling the trainer would wait for the held jobs, and the steps would never come.

The run has no step budget that a fast machine could exhaust before the faults (800 steps once ended before
the second began): it trains until the test has seen both, then the PS is killed and relaunched to train
END_STEPS past its newest checkpoint, a resume like any after a crash, and the exactly-once check covers it."""

import json
import os
import signal
import subprocess
import sys
import time

import helpers
from helpers import (
    LEDGER_FILE,
    PROCESS_ENV,
    REPO,
    assert_exactly_once,
    demo_flags,
    expect_exit,
    log_tail,
    metrics,
    ps_events,
    run_flags,
    start_process,
)

MIN_STEPS_IN_FAULT = 10  # each fault lasts until the trainer has trained this many steps beside it
UNREACHED_STEPS = 100_000  # the first PS life's budget: the test ends that life itself
END_STEPS = 20  # what the relaunched PS trains past its newest checkpoint
# The demo task with another reward.
TASK_FLAGS = [*demo_flags(), "--reward_funcs", "tests.processes.reward_faults:slow_once_when_told"]
FLAGS = [*TASK_FLAGS, *run_flags(UNREACHED_STEPS, save_steps=100, lease_s=60)]
TIMEOUT_S = 300


def wait_for(condition, what: str, *procs):
    """helpers.wait_for within TIMEOUT_S, failing early if one of ``procs`` exits."""
    return helpers.wait_for(condition, what, TIMEOUT_S, procs=procs)


def step(root) -> int:
    lines = metrics(root)
    return lines[-1]["step"] if lines else 0


def saved_step(root) -> int:
    """The step of the newest complete checkpoint (its ledger written last), 0 before there is one."""
    return max((int(p.name.split("-")[1]) for p in (root / "checkpoints").glob("checkpoint-*")
                if (p / LEDGER_FILE).is_file()), default=0)


def held_by(root, device: int) -> list[str]:
    return [n for n in os.listdir(root / "queue") if f"_processing_by_dev{device}" in n or
            f"_committing_by_dev{device}" in n]


def stop_while_holding_a_job(root, worker, device: int, ps) -> list[str]:
    """SIGSTOPs ``worker`` at a moment it holds a job (checked after the stop); returns the held files."""
    while True:
        wait_for(lambda: held_by(root, device), f"dev{device} to hold a job", worker, ps)
        worker.send_signal(signal.SIGSTOP)
        # (the signal lands after send_signal returns: a worker looked at before it stopped could still finish the job)
        helpers.wait_until_stopped(worker, TIMEOUT_S)
        if held := held_by(root, device):
            return held
        worker.send_signal(signal.SIGCONT)  # it finished that job between the look and the stop


def test_a_slow_worker_and_a_stopped_worker_do_not_stall_the_trainer(tmp_path):
    root, slow = tmp_path / "run", tmp_path / "slow"
    slow.mkdir()
    env_slow = {**PROCESS_ENV, "ASYNCGRPO_TEST_SLOW": str(slow), "ASYNCGRPO_TEST_SLOW_S": str(TIMEOUT_S)}
    ps = start_process(root, tmp_path / "ps.log", "ps", *FLAGS)
    workers = {1: start_process(root, tmp_path / "w1.log", "worker", "--device", "1", *FLAGS),
               2: start_process(root, tmp_path / "w2.log", "worker", "--device", "2", *FLAGS),
               3: start_process(root, tmp_path / "w3.log", "worker", "--device", "3", *FLAGS, env=env_slow)}
    try:
        wait_for(lambda: step(root) >= 20, "20 steps", ps, *workers.values())
        # 1. Worker 3's next reward call lasts until the trainer has trained MIN_STEPS_IN_FAULT steps beside it
        # (it never does if the trainer waits for that worker's jobs): alive (heartbeats), holding its jobs.
        (slow / "go").touch()
        wait_for((slow / "slow").exists, "the slow reward call", ps, *workers.values())
        slow_start, slow_since = step(root), time.monotonic()
        wait_for(lambda: step(root) >= slow_start + MIN_STEPS_IN_FAULT,
                 f"{MIN_STEPS_IN_FAULT} steps trained while a worker's reward call hangs", ps, *workers.values())
        (slow / "release").touch()
        wait_for((slow / "done").exists, "the slow reward call to end", ps, *workers.values())
        slow_window, slow_s = (slow_start, step(root)), time.monotonic() - slow_since
        # 2. Worker 2 is stopped while it holds a job: no heartbeat, no progress.
        held = stop_while_holding_a_job(root, workers[2], 2, ps)
        stopped_at, stop_step = time.monotonic(), step(root)
        try:
            helpers.backdate(root / "workers" / "dev2.json", 7.0)  # its heartbeat, as if stopped 7 s ago
            ls = subprocess.run([sys.executable, "-m", "queue_tools", "ls", str(root), "--json"], cwd=REPO,
                                env=PROCESS_ENV, capture_output=True, text=True, timeout=60, check=True)
            listing = json.loads(ls.stdout)
            dev2 = next(w for w in listing["workers"] if w["device"] == 2)
            assert dev2["heartbeat_age_s"] > 6.0 and dev2["held"], dev2
            assert listing["health"].startswith("WARN") and "dev2 silent for" in listing["health"], listing["health"]
            wait_for(lambda: step(root) >= stop_step + MIN_STEPS_IN_FAULT,
                     f"{MIN_STEPS_IN_FAULT} steps trained while a worker is stopped holding a job", ps, workers[1])
        finally:
            workers[2].send_signal(signal.SIGCONT)
        stop_window, stop_s = (stop_step, step(root)), time.monotonic() - stopped_at
        assert ps.poll() is None, log_tail(tmp_path / "ps.log")
        wait_for(lambda: saved_step(root), "a checkpoint", ps, *workers.values())
        ps.kill()
        ps.wait(timeout=60)
        steps = saved_step(root) + END_STEPS  # the relaunch resumes from it
        ps = start_process(root, tmp_path / "ps2.log", "ps", *TASK_FLAGS,
                           *run_flags(steps, save_steps=100, lease_s=60))
        expect_exit(ps, 0, tmp_path / "ps2.log", TIMEOUT_S)
    finally:
        for worker in workers.values():
            worker.send_signal(signal.SIGCONT)
            worker.terminate()
        codes = [worker.wait(timeout=120) for worker in workers.values()]
    assert codes == [0, 0, 0], codes

    # The trainer kept training through both faults (the waits above), and no wait for a result in those steps
    # lasted as long as the fault beside it: it never waited a fault out.
    waits = {e["step"]: e["dur_ms"] / 1e3 for e in ps_events(root, "wait_result")}
    for (start, end), fault_s in ((slow_window, slow_s), (stop_window, stop_s)):
        longest = max((waits[s] for s in range(start + 1, end + 1) if s in waits), default=0.0)
        assert longest < fault_s, f"the trainer waited {longest:.1f} s for a result during a {fault_s:.1f} s fault"
    straggling = {e["job_id"] for e in ps_events(root, "job_straggling")}
    assert {name[:10] for name in held} <= straggling, (held, straggling)  # named as stragglers by the PS
    assert_exactly_once(root, jobs=steps)
