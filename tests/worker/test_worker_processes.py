"""Real worker processes race, get SIGKILLed at each protocol step, and get SIGSTOPped past
their lease. After recovery every job is consumed exactly once. A real worker (python -m
worker) whose GPU fails exits with one line and status 3, and its job comes back."""

import dataclasses
import errno
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter

import pytest
from helpers import (
    PROCESS_ENV,
    PYTHON,
    REPO,
    TESTS,
    assert_exactly_once,
    backdate,
    dead_pid,
    demo_config,
    expect_exit,
    log_tail,
    read_json,
    run_flags,
    start_script,
    wait_for,
    wait_until_stopped,
)

from asyncgrpo.jobqueue import JobQueue, make_job_id
from asyncgrpo.jobqueue.names import done_reason
from asyncgrpo.run import RunDir
from asyncgrpo.run.rundir import PSStatus
from asyncgrpo.tasks.demo import write_demo_model

pytestmark = pytest.mark.process

WORKER = TESTS / "processes" / "queue_worker.py"
LEASE_S = 30.0
PROCESS_TIMEOUT_S = 180


def start_worker(run, device, *args, **popen):
    return start_script(WORKER, str(run.root), "--device", str(device), *args, **popen)


def finish(proc) -> list:
    out, _ = proc.communicate(timeout=PROCESS_TIMEOUT_S)
    return [json.loads(line) for line in out.splitlines() if line.strip() and line != "ready"]


def queue_files(run):
    return sorted(n for n in os.listdir(run.queue) if n != ".tmp")


def consume_all(queue) -> list[str]:
    return [r.job_id for r in queue.collect() if queue.consume(r)]


def done_reasons(run) -> Counter:
    return Counter(done_reason(n).value for n in os.listdir(run.done))


def test_eight_processes_race_for_ten_thousand_jobs_each_claimed_once(run):
    queue = JobQueue(run, fsync=False)  # this test is about exclusivity, not durability
    job_ids = [make_job_id(i // 1000, i % 1000) for i in range(10_000)]
    for job_id in job_ids:
        queue.put_job(job_id, {"n": job_id}, created_step=0)
    racers = [start_worker(run, device, "--claim-only", "--wait-for-go", stdin=subprocess.PIPE)
              for device in range(8)]
    for proc in racers:
        assert proc.stdout.readline().strip() == "ready"
    for proc in racers:  # all are loaded and waiting: start them together
        proc.stdin.write("go\n")
        proc.stdin.flush()
    claims = {}
    for device, proc in enumerate(racers):
        claims[device] = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=PROCESS_TIMEOUT_S) == 0
    everything = [job_id for ids in claims.values() for job_id in ids]
    assert len(everything) == len(job_ids)
    assert set(everything) == set(job_ids)
    assert sum(1 for ids in claims.values() if ids) >= 2, "no race happened"
    owners = {n.split("_processing_by_dev")[0]: int(n.split("_by_dev")[1][:-3]) for n in queue_files(run)}
    assert all(owners[job_id] == device for device, ids in claims.items() for job_id in ids)


@pytest.mark.parametrize("crash_at", ["after_claim", "mid_result_write", "after_fence", "before_archive"])
def test_worker_killed_at_each_protocol_step_loses_and_repeats_nothing(run, crash_at):
    queue = JobQueue(run)
    job_ids = [make_job_id(1, i) for i in range(4)]
    for job_id in job_ids:
        queue.put_job(job_id, {"n": job_id}, created_step=1)

    crashed = start_worker(run, 1, "--crash-at", crash_at)
    assert crashed.wait(timeout=PROCESS_TIMEOUT_S) == -signal.SIGKILL
    crashed.communicate()
    first = job_ids[0]
    left = queue_files(run)
    temp_files = os.listdir(run.tmp)
    if crash_at in ("after_claim", "mid_result_write"):
        assert f"{first}_processing_by_dev1.pt" in left
    else:
        assert f"{first}_committing_by_dev1.pt" in left
    if crash_at == "mid_result_write":
        [partial] = temp_files  # half a result, and nothing under a final name
        assert 0 < os.path.getsize(run.tmp / partial)
        assert not any("complete" in n for n in left)
    if crash_at == "before_archive":
        assert f"{first}_complete_from_dev1.pt" in left

    actions = queue.recover(lease_s=LEASE_S)  # the dead worker's lock is free: no waiting for the lease
    expected = [("archive" if crash_at == "before_archive" else "requeue", first)]
    expected += [("reap", None)] * len(temp_files)  # their writer is dead: reaped at once, young as they are
    assert [(a.what, a.job_id) for a in actions] == expected
    assert os.listdir(run.tmp) == []

    rescuer = start_worker(run, 2, "--until-empty")
    finish(rescuer)
    assert rescuer.returncode == 0
    consumed = consume_all(queue)
    assert sorted(consumed) == job_ids
    assert queue_files(run) == []
    reasons = done_reasons(run)
    assert reasons["consumed"] == len(job_ids)
    assert reasons["processed"] == len(job_ids)
    assert set(reasons) == {"consumed", "processed"}


@pytest.mark.parametrize("stop_at", ["after_claim", "after_fence"])
def test_worker_paused_past_its_lease_is_never_consumed_twice(run, stop_at):
    queue = JobQueue(run)
    job_id = make_job_id(2, 0)
    queue.put_job(job_id, {"n": 1}, created_step=2)
    paused = start_worker(run, 1, "--stop-at", stop_at, "--max-jobs", "1")
    try:
        wait_until_stopped(paused, PROCESS_TIMEOUT_S)
        [held] = queue_files(run)
        assert queue.recover(lease_s=LEASE_S) == []  # alive and within its lease: left alone
        backdate(run.workers / "dev1.json", 2 * LEASE_S)
        backdate(run.queue / held, 2 * LEASE_S)
        [action] = queue.recover(lease_s=LEASE_S)
        assert (action.what, action.dst) == ("requeue", f"{job_id}_pending_a2.pt")

        rescuer = start_worker(run, 2, "--until-empty")
        assert finish(rescuer) == [{"job_id": job_id, "attempt": 2, "published": True}]
        assert consume_all(queue) == [job_id]
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    late = finish(paused)
    assert paused.returncode == 0
    # Before its fence the late worker finds its job gone and drops the result; after its
    # fence it publishes, and the collector archives that result as a duplicate.
    assert late == [{"job_id": job_id, "attempt": 1, "published": stop_at == "after_fence"}]
    assert consume_all(queue) == []
    assert queue_files(run) == []
    reasons = done_reasons(run)
    assert reasons["consumed"] == 1
    assert reasons["duplicate"] == (1 if stop_at == "after_fence" else 0)


# ---------------------------------------------------------------- a worker whose GPU fails

# The real worker, except that generation fails the way a GPU with a broken CUDA context does.
BROKEN_GPU_WORKER = """
import sys
import torch
import worker.generate

def generate_on_a_broken_gpu(*args, **kwargs):
    raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered\\n"
                                 "CUDA kernel errors might be asynchronously reported at some other API call")

worker.generate.generate_jobs = generate_on_a_broken_gpu
from worker.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def start_demo_process(log_path, argv):
    with open(log_path, "ab") as log:
        return subprocess.Popen([PYTHON, *argv], cwd=REPO, env=PROCESS_ENV, stdout=log,
                                stderr=subprocess.STDOUT)


def stop(*procs) -> None:
    """SIGTERM to each of ``procs`` (None: not started) still running, its exit awaited."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def test_worker_whose_gpu_fails_exits_3_with_one_line_and_its_job_is_retried(tmp_path):
    root = tmp_path / "run"
    flags = ["--run_dir", str(root), *run_flags(2)]
    ps = start_demo_process(tmp_path / "ps.log", ["-m", "ps", *flags])
    broken = start_demo_process(tmp_path / "broken.log", ["-c", BROKEN_GPU_WORKER, "--device", "1", *flags])
    healthy = None
    try:
        # The worker exits, or (the fault this guards) fails its job and carries on: whichever comes first.
        wait_for(lambda: broken.poll() is not None or list((root / "done").glob("*_failed*")),
                 "the broken worker to exit or fail its job", 600, procs=(ps,), log=tmp_path / "ps.log")
        assert broken.poll() == 3, (f"exit status {broken.returncode} (None: still running, its job archived "
                                    "failed)\n" + log_tail(tmp_path / "broken.log"))
        log = (tmp_path / "broken.log").read_text()
        assert log.strip().splitlines()[-1].endswith(
            "ERROR [worker] dev1 exits (status 3): its GPU failed with AcceleratorError: CUDA error: an illegal "
            "memory access was encountered; a new process gets a new CUDA context")
        assert "Traceback" not in log and "job_failed" not in log
        held = re.findall(r"claimed job=(\S+) attempt=1", log)  # one generate call's jobs (--jobs_per_generate)
        assert held
        # The next process starts once recovery has put them back in pending (attempt 2). Started sooner, it
        # could claim the jobs behind them and the run train its 2 steps before recovery noticed the exit (they
        # would then be archived unused): which jobs trained would depend on timing.
        wait_for(lambda: all((root / "queue" / f"{job_id}_pending_a2.pt").exists() for job_id in held),
                 "the held jobs back in pending", 600, procs=(ps,), log=tmp_path / "ps.log")
        healthy = start_demo_process(tmp_path / "healthy.log", ["-m", "worker", "--device", "1", *flags])
        expect_exit(ps, 0, tmp_path / "ps.log", 600)
    finally:
        for proc in (ps, broken, healthy):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    done = os.listdir(root / "done")
    assert not [n for n in done if "_failed" in n], done
    # Not failed: recovery gave them back (attempt 2), the next process generated them, the PS trained on them.
    for job_id in held:
        assert f"{job_id}_processed_a2.pt" in done and f"{job_id}_consumed.pt" in done, done


# ---------------------------------------------------------------- a worker that cannot build its trainer

# The real worker, except that TRL's trainer refuses to be built the way transformers refuses a flag.
UNBUILDABLE_WORKER = """
import sys
import worker.loop

def refuse(*args, **kwargs):
    raise ValueError("Using fsdp only works in distributed training.")

worker.loop.build_trainer = refuse
from worker.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_worker_that_cannot_build_its_trainer_exits_2_with_one_line(tmp_path):
    """Not a crash to restart (exit 1): the same config fails the same way, so bad input (exit 2), which
    launch.sh does not restart; the traceback stays in the worker's log."""
    root = tmp_path / "run"
    root.mkdir()
    (root / "ps.json").write_text("{}")  # a worker waits for its PS (which writes the demo model) before loading it
    write_demo_model(root / "demo_model")
    worker = subprocess.run([PYTHON, "-c", UNBUILDABLE_WORKER, "--device", "1", "--run_dir", str(root)],
                            cwd=REPO, env=PROCESS_ENV, capture_output=True, text=True, timeout=300)
    assert worker.returncode == 2, worker.stderr[-3000:]
    assert worker.stderr.strip().splitlines()[-1] == (
        "worker: error: could not build its model and trainer: ValueError: Using fsdp only works in distributed "
        "training. (traceback in the worker's log)")
    assert "Traceback" in worker.stderr


def test_a_worker_started_with_other_generation_flags_than_the_ps_gives_its_job_back_and_exits_2(tmp_path):
    """The PS writes its generation flags in ps.json: a worker whose own differ (another host's, typed again by
    hand) releases the job it claimed (no attempt used) and exits 2 naming the flag; a worker started with the
    PS's flags then trains every job once."""
    root = tmp_path / "run"
    flags = ["--run_dir", str(root), *run_flags(2, lease_s=None)]
    ps = start_demo_process(tmp_path / "ps.log", ["-m", "ps", *flags])
    healthy = None
    try:
        odd = subprocess.run([PYTHON, "-m", "worker", "--device", "1", *flags, "--temperature", "0.5"],
                             cwd=REPO, env=PROCESS_ENV, capture_output=True, text=True, timeout=300)
        assert odd.returncode == 2, odd.stderr[-3000:]
        assert odd.stderr.strip().splitlines()[-1] == (
            "worker: error: this worker's flags are not the parameter server's: --temperature 0.5 (the parameter "
            "server's: 1.0); start it with the parameter server's config flags")
        healthy = start_demo_process(tmp_path / "healthy.log", ["-m", "worker", "--device", "1", *flags])
        expect_exit(ps, 0, tmp_path / "ps.log", 600)
    finally:
        stop(ps, healthy)
    assert_exactly_once(root, jobs=2)
    done = os.listdir(root / "done")
    assert not [n for n in done if "_failed" in n or "_retried" in n or "_a2" in n], done


@pytest.mark.parametrize("where", ["this host", "another host"])
def test_a_worker_beside_a_relaunched_ps_is_not_refused_by_the_interrupted_ones_flags(tmp_path, where):
    """An interrupted PS leaves ps.json saying it trains with its flags, until the relaunched PS writes its own once
    its model and trainer are built; launch.sh starts the workers beside it. Relaunched with another --temperature,
    every worker compared itself with the dead PS's flags and exited 2 (bad input, not restarted): the run stopped,
    and each such relaunch left its own flags in ps.json for the next one to fail against. Here the worker starts
    first, with the dead PS's status in ps.json (its pid dead here, or on another host, whose pid means nothing
    here, its heartbeat standing still), and the PS with the worker's flags after it."""
    root = tmp_path / "run"
    flags = ["--run_dir", str(root), *run_flags(2, lease_s=None), "--temperature", "0.7"]
    write_demo_model(root / "demo_model")
    interrupted = PSStatus.starting(str(root / "demo_model"), None,
                                    demo_config(tmp_path, temperature=1.0).generation_settings())
    elsewhere = {"host": "another-host", "host_id": "another-host/0000/0000"} if where == "another host" else {}
    RunDir(root).write_ps_status(dataclasses.replace(interrupted, pid=dead_pid(), **elsewhere))
    last_beat = time.time() - 60
    RunDir(root).ps_heartbeat_file.touch()
    os.utime(RunDir(root).ps_heartbeat_file, (last_beat, last_beat))  # (it was interrupted a minute ago)
    worker = start_demo_process(tmp_path / "worker.log", ["-m", "worker", "--device", "1", *flags])
    ps = None
    try:
        wait_for(lambda: read_json(root / "workers" / "dev1.json").get("state") == "idle", "the worker set up",
                 timeout=PROCESS_TIMEOUT_S, procs=[worker], log=tmp_path / "worker.log")
        ps = start_demo_process(tmp_path / "ps.log", ["-m", "ps", *flags])
        expect_exit(ps, 0, tmp_path / "ps.log", 600)
    finally:
        stop(ps, worker)
    assert worker.returncode == 0, log_tail(tmp_path / "worker.log")
    assert "Warning" not in (tmp_path / "worker.log").read_text()  # (none a user could act on: a library's of another)
    assert_exactly_once(root, jobs=2)


@pytest.mark.parametrize("device", ["1000", "-1"])
def test_a_worker_id_outside_the_file_name_grammar_is_refused_at_start(tmp_path, capsys, device):
    # Its files (devN) would not parse: its jobs would be archived failed_load without a word.
    from worker.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--device", device, "--run_dir", str(tmp_path / "run")])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"worker: error: --device {device}: must be a number from 0 to 999 (it names the worker's files: devN)"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("code, status", [(errno.ENOSPC, 1), (errno.EDQUOT, 1), (errno.EACCES, 2)])
def test_a_full_disk_is_not_bad_input_a_restart_would_repeat(tmp_path, monkeypatch, capsys, code, status):
    """Exit 2 tells launch.sh not to restart the worker: a full disk may have room again (the PS, on the same disk, says
    so and stops; on another host, the run goes on)."""
    import worker.__main__ as worker_main

    def full(*args):
        raise OSError(code, os.strerror(code), str(tmp_path / "run" / "workers" / "dev1.json"))

    monkeypatch.setattr(worker_main, "run_worker", full)
    assert worker_main.main(["--device", "1", "--run_dir", str(tmp_path / "run")]) == status
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("worker: error: " + ("no space left on the disk: " if status == 1 else "")), line
