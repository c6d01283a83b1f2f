"""The parameter server and workers as real processes on the demo task (CPU, tiny model).

Every job is consumed exactly once, weights versions advance, staleness stays within
its bound, a SIGKILLed PS resumes from its checkpoint, and launch.sh rejects bad input
before starting anything. (Workers killed holding jobs: tests/e2e/test_chaos.py at random
moments, test_jobs_per_generate.py holding several, test_in_flight_e2e.py inside a sync,
test_second_host.py on another host; tests/worker/test_worker_processes.py at each step of
the protocol.)
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    LEDGER_FILE,
    OWN_SERVER_ENV,
    PROCESS_ENV,
    REPO,
    RunProcesses,
    assert_exactly_once,
    expect_exit,
    heartbeat_pid,
    kill_run,
    launch_in_group,
    metrics,
    modes_beyond,
    pid_alive,
    process_state,
    ps_events,
    run_flags,
    start_faulty_ps,
    start_process,
    stopped_status,
    wait_for,
)

from asyncgrpo.events import read_events
from asyncgrpo.jobqueue import JobQueue
from asyncgrpo.jobqueue.names import done_reason
from asyncgrpo.run import RunDir, fileops
from asyncgrpo.weights.buffer_folders import run_tag
from queue_tools.report import make_report

TIMEOUT_S = 600
SAVE_STEPS = 3
FAST = run_flags(save_steps=SAVE_STEPS)


def wait_for_steps(run_root, n, proc):
    """Until the PS (or launch.sh: ``proc``) has logged ``n`` steps in RUN/metrics.jsonl."""
    wait_for(lambda: len(metrics(run_root)) >= n, f"step {n}", TIMEOUT_S, procs=(proc,), poll_s=0.1)


def assert_queue_drained(run_root):
    counts = JobQueue(RunDir.open(run_root)).counts()
    assert counts == {"pending": 0, "processing": 0, "committing": 0, "complete": 0, "collected": 0}, counts
    assert all(done_reason(n) is not None for n in os.listdir(Path(run_root) / "done"))


def test_ps_and_two_workers_train_on_every_job_exactly_once(finished_demo_run):
    run_root = finished_demo_run  # --max_steps 8, FAST flags (tests/conftest.py)
    lines = metrics(run_root)
    assert [m["step"] for m in lines] == list(range(1, 9))
    assert all(m["staleness_max"] <= 4 for m in lines)  # the default max_staleness
    versions = [m["weights_version"] for m in lines]
    # Versions advance; per step they need not be monotonic ('ready' may take an older result
    # after a newer one), which is what the staleness bound above is for.
    assert versions[-1] > versions[0] and max(versions) >= len(lines) - 1 - 4
    ids = assert_exactly_once(run_root, jobs=8)
    # No PS restart: each job was taken by the trainer once, and those are the ledger's.
    taken = [r["job_id"] for r in ps_events(run_root, "result_consumed")]
    assert sorted(taken) == sorted(ids), taken
    assert_queue_drained(run_root)
    assert (run_root / "global_step.txt").read_text().strip() == "8"
    assert_events_trace_every_job(run_root, ids)
    # The logs dict every TrainerCallback (and so each report_to integration) gets carries asyncgrpo's metrics.
    logged = (run_root.parent / "ps.log").read_text()
    assert all(f"'{key}'" in logged for key in ("staleness/mean", "staleness/max", "trainer_wait_s", "reward"))


def assert_events_trace_every_job(run_root, consumed):
    """Each consumed job's life is in the timeline events, in order, across the processes."""
    records = read_events(run_root)
    by_job = {}
    for r in sorted(records, key=lambda r: r["mono"]):
        assert {"event", "t", "mono", "pid", "process", "role", "device"} <= r.keys(), r
        by_job.setdefault(r.get("job_id"), []).append((r["role"], r["event"]))
    life = [("ps", "job_created"), ("worker", "job_claimed"), ("worker", "generate_start"), ("worker", "generate_end"),
            ("worker", "score_start"), ("worker", "score_end"),
            ("ps", "result_collected"), ("ps", "result_archived"), ("ps", "result_consumed")]
    for job_id in consumed:
        seen = by_job[job_id]
        # result_written is logged once complete() returns, which may be after the PS collected it
        assert all(e in seen for e in life) and ("worker", "result_written") in seen, (job_id, seen)
        firsts = [seen.index(e) for e in life]
        assert firsts == sorted(firsts), (job_id, seen)
    steps = [r for r in records if r["event"] == "train_step_end"]
    assert [r["step"] for r in steps] == list(range(1, 9)) and all(r["dur_ms"] >= r["wait_ms"] >= 0 for r in steps)


def test_a_ps_killed_inside_a_save_resumes_from_the_checkpoint_before(tmp_path):
    run_root = tmp_path / "run"
    args = ["--max_steps", "20", *FAST]
    # Killed in the save of checkpoint-9 (its model written, not its optimizer nor its ledger), right after
    # logging steps 7-9: a resume must start after checkpoint-6, drop the unfinished save and those lines.
    with RunProcesses(run_root, *args) as run:
        faulty = run.add(start_faulty_ps(run_root, tmp_path / "ps.log", "kill-mid-save", 9, *args))
        run.workers(1, 2)
        expect_exit(faulty, -signal.SIGKILL, tmp_path / "ps.log", TIMEOUT_S)
        killed_at = time.time()
        partial = run_root / "checkpoints" / "checkpoint-9"
        assert {p.name for p in partial.iterdir()} >= {"model.safetensors"} and not (partial / LEDGER_FILE).exists()
        assert [m["step"] for m in metrics(run_root)] == list(range(1, 10))
        run.ps()  # same run directory: resume
        run.expect_ps_exit(0, TIMEOUT_S)
    lines = metrics(run_root)
    assert min(m["step"] for m in lines if m["time"] > killed_at) == 7  # after checkpoint-6, not the partial 9
    assert all((p / LEDGER_FILE).is_file() for p in (run_root / "checkpoints").glob("checkpoint-*"))  # no partial
    # Each step once: the killed PS's lines after the checkpoint were removed, as their training was lost.
    assert [m["step"] for m in lines] == list(range(1, 21))
    # Every archived consumption is in the final model's ledger, once, including the jobs the killed
    # PS had consumed after its last checkpoint (they were trained again by the resumed one).
    assert_exactly_once(run_root, jobs=20)
    assert_queue_drained(run_root)
    # queue_tools report: the time between the two PS lives is downtime, left out of the training span.
    report = make_report(RunDir(run_root))
    steps = ps_events(run_root, "train_step_start") + ps_events(run_root, "train_step_end")
    first_to_last = max(e["mono"] for e in steps) - min(e["mono"] for e in steps)
    assert report["downtime"]["restarts"] == 1 and report["downtime"]["down_s"] > 0
    assert report["training"]["span_s"] + report["downtime"]["down_s"] == pytest.approx(first_to_last)


# launch.sh's own refusals, and a flag the PS does not know through it (every bad input's line is checked in
# process, and one through launch.sh from a user's folder: tests/asyncgrpo/test_cli_inputs.py).
@pytest.mark.parametrize("args, message", [
    (["--frobnicate", "1"], "--frobnicate: not a flag"),
    (["--workers", "zero"], "--workers needs a number (0: workers join from other hosts), got 'zero'"),
    (["--ps-procs", "0"], "--ps-procs needs a positive integer"),
])
def test_launch_rejects_bad_input_before_starting_anything(tmp_path, args, message):
    (tmp_path / "a_file").write_text("x")
    args = [a.format(tmp=tmp_path) for a in args]
    if "--run-dir" not in args:
        args += ["--run-dir", str(tmp_path / "run")]
    result = subprocess.run(["bash", str(REPO / "launch.sh"), "--workers", "2", *args], cwd=REPO, env=PROCESS_ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert not (tmp_path / "run" / "queue").exists()  # nothing started


@pytest.mark.slow
def test_demo_task_learns_with_two_workers(tmp_path):
    """Mean reward rises from about 0.1 to >= 0.8 (a typical run passes 0.9 by step ~200)."""
    run_root = tmp_path / "run"
    with RunProcesses(run_root, "--max_steps", "350") as run:
        run.ps("--seed", "0")
        run.workers(1, 2)
        run.expect_ps_exit(0, TIMEOUT_S)
    rewards = [m["reward"] for m in metrics(run_root)]
    first, best = sum(rewards[:10]) / 10, max(sum(rewards[i:i + 20]) / 20 for i in range(len(rewards) - 19))
    assert first < 0.3, f"the untrained model already scores {first:.2f}"
    assert best >= 0.8, f"the best 20-step mean reward is {best:.2f}"


def frozen_holding_a_job(pid: int, run_root: Path) -> str | None:
    """Stops ``pid`` (SIGSTOP: nothing moves while it is looked at) and returns the name of a job file it holds,
    leaving it stopped; None, and it continued, when it holds none."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: process_state(pid) == "T", f"pid {pid} to stop", TIMEOUT_S)
    held = sorted(p.name for p in (run_root / "queue").glob("*_processing_by_dev1*"))
    if held:
        return held[0]
    os.kill(pid, signal.SIGCONT)
    return None


def test_launch_restarts_a_dead_worker_and_ctrl_c_stops_everything(tmp_path):
    run_root = tmp_path / "run"
    proc = launch_in_group(run_root, "--workers", "2", "--max-steps", "100000", "--lease_s", "4")
    try:
        first = heartbeat_pid(run_root, 1, TIMEOUT_S, procs=(proc,))
        wait_for_steps(run_root, 3, proc)
        # The weight buffers are the owner's alone, as the rest of the run (checked below, once it ended).
        buffers = list(Path("/dev/shm").glob(f"asyncgrpo-weights-{run_tag(RunDir(run_root.resolve()))}-*"))
        assert len(buffers) == 1 and modes_beyond(buffers[0], 0o700) == []
        held = wait_for(lambda: frozen_holding_a_job(first, run_root), "worker 1 to hold a job", TIMEOUT_S,
                        procs=(proc,))
        os.kill(first, signal.SIGKILL)
        # The restarted worker beats with its own pid.
        second = heartbeat_pid(run_root, 1, TIMEOUT_S, not_pid=first, procs=(proc,))
        logs = [run_root / "logs" / name for name in ("log_worker_1.txt", "log_parameter_server.txt")]
        wait_for(lambda: any(f"[queue] recover: requeue {held}" in p.read_text() for p in logs),
                 "the job the killed worker held to be recovered", TIMEOUT_S, procs=(proc,))
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: every process of the group, the PS too
        assert stopped_status(proc, run_root) == 130
    finally:
        kill_run(run_root, proc)
    out = proc.stdout.read()
    # The pid killed, the worker's own (as its heartbeat and queue_tools ls show it), not its fork server client's.
    assert f"worker 1 (pid {first}) exited with status 137: restarting it" in out, out
    assert f"[queue] recover: requeue {held}" in out, out  # the terminal says where its job went
    assert "interrupted: stopping" in out
    workers = [second, heartbeat_pid(run_root, 2, TIMEOUT_S)]
    ps_pid = json.loads((run_root / "ps.json").read_text())["pid"]
    assert not any(pid_alive(pid) for pid in [ps_pid, *workers])
    root = str(run_root.resolve())  # the interrupted PS freed its shared-memory weight buffers
    owners = [fileops.read_json(d / "owner.json") or {} for d in Path("/dev/shm").glob("asyncgrpo-weights-*")]
    assert not [o for o in owners if o.get("run") == root], owners
    assert modes_beyond(run_root, 0o700) == []  # launch.sh's logs included


def test_a_closed_terminal_stops_the_run_as_ctrl_c_does(tmp_path):
    """SIGHUP to the process group (the terminal closed, an ssh session dropped): every process stops as on
    Ctrl-C, instead of dying where it stands: the PS frees its weight buffers, no worker dies holding a job. (The
    launch runs its own fork server, as a user's does: in the group too, it outlives the signal.)"""
    run_root = tmp_path / "run"
    proc = launch_in_group(run_root, "--workers", "2", "--max-steps", "100000", "--device", "cpu",
                           env=OWN_SERVER_ENV)  # (on CPU: a fork server runs on a GPU machine too)
    try:
        workers = [heartbeat_pid(run_root, device, TIMEOUT_S, procs=(proc,)) for device in (1, 2)]
        wait_for_steps(run_root, 3, proc)
        for device in (1, 2):  # past its set-up (a worker still loading stops at once, with another line)
            log = run_root / "logs" / f"log_worker_{device}.txt"
            wait_for(lambda log=log: "claimed job=" in log.read_text(), f"worker {device} to claim a job", TIMEOUT_S,
                     procs=(proc,), poll_s=0.1)
        os.killpg(proc.pid, signal.SIGHUP)
        assert stopped_status(proc, run_root) == 128 + signal.SIGHUP
    finally:
        kill_run(run_root, proc)
    out = proc.stdout.read()
    assert "got SIGHUP: stopping the parameter server and the workers (a second signal kills them now)" in out, out
    ps_pid = json.loads((run_root / "ps.json").read_text())["pid"]
    assert not any(pid_alive(pid) for pid in [ps_pid, *workers])
    assert "[train] interrupted" in (run_root / "logs" / "log_parameter_server.txt").read_text()
    for device in (1, 2):  # each worker stopped (the job in hand finished or given back), not killed by the signal
        log = (run_root / "logs" / f"log_worker_{device}.txt").read_text()
        assert "got signal 1: finishing the job in hand" in log and "the fork server died" not in log
    assert not list((run_root / "queue").glob("*_processing_*")), "a worker died holding a job"
    root = str(run_root.resolve())  # the PS freed its shared-memory weight buffers itself
    owners = [fileops.read_json(d / "owner.json") or {} for d in Path("/dev/shm").glob("asyncgrpo-weights-*")]
    assert not [o for o in owners if o.get("run") == root], owners


def test_under_nohup_a_closed_terminal_changes_nothing(tmp_path):
    """nohup bash launch.sh ...: SIGHUP stays ignored in every process, and the run trains to its end."""
    run_root = tmp_path / "run"
    proc = launch_in_group(run_root, "--workers", "2", "--max-steps", "40", nohup=True)
    try:
        wait_for_steps(run_root, 3, proc)
        os.killpg(proc.pid, signal.SIGHUP)
        assert proc.wait(timeout=300) == 0, proc.stdout.read()[-3000:]
    finally:
        kill_run(run_root, proc)
    assert [m["step"] for m in metrics(run_root)][-1] == 40


def test_a_finished_run_resumed_for_more_steps_says_how_its_learning_rate_schedule_changes(tmp_path):
    """The demo: learning rate 1e-3, linear to 0 at max_steps. Trained to 4 steps its rate reached 0; resumed
    towards 8, transformers recomputes the schedule, and the rate at step 4 is 1e-3 * 4/8. (A PS relaunched on
    the run of a worker that waits for it, as launch.sh's relaunch would be.)"""
    run, ps_log = tmp_path / "run", tmp_path / "ps.log"
    worker = start_process(run, tmp_path / "worker.log", "worker", "--device", "1", "--seed", "0")
    try:
        first = start_process(run, ps_log, "ps", *run_flags(4, save_steps=2))
        expect_exit(first, 0, ps_log, TIMEOUT_S)
        assert "learning-rate schedule" not in ps_log.read_text()
        second = start_process(run, ps_log, "ps", *run_flags(8, save_steps=2))
        expect_exit(second, 0, ps_log, TIMEOUT_S)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    [line] = [x for x in ps_log.read_text().splitlines() if "learning-rate schedule" in x]
    assert line.split(" INFO ")[1].startswith(
        "[train] resumed at step 4 of a run trained towards max_steps=4, now max_steps=8: the learning-rate schedule "
        "(linear) is recomputed over 8 steps: the learning rate goes from ")
    assert line.endswith(" (its last step's) to 0.0005")
