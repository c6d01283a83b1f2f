"""Ctrl-C (SIGINT to launch.sh's process group, as a terminal sends it) at the moments where a stop used to look
hung or left a mess: while the workers compile, before the PS has made the run, and a second Ctrl-C while the
first one's stop waits for a worker in the middle of a reward. (Ctrl-C during training, a closed terminal, nohup:
tests/e2e/test_e2e.py.)"""

import os
import signal

import pytest
from helpers import (
    OWN_SERVER_ENV,
    launch_in_group,
    pid_alive,
    read_json,
    stopped_status,
    wait_for,
    write_user_folder,
)

from asyncgrpo.run import RunDir, RunDirError

pytestmark = pytest.mark.process

TIMEOUT_S = 300


def test_ctrl_c_while_the_workers_compile_stops_them_at_once(tmp_path):
    """A worker compiling its decoding step holds no job: it stops at once, not after its compilation (the engine
    of continuous batching takes seconds even from a warm compile cache, a minute cold). The terminal shows the
    PS's last line."""
    run_root = tmp_path / "run"
    proc = launch_in_group(run_root, "--workers", "1", "--max-steps", "100000", "--worker_decoding", "continuous")
    log = run_root / "logs" / "log_worker_1.txt"
    try:
        wait_for(lambda: log.exists() and "compiling its decoding step" in log.read_text(), "the worker to compile",
                 TIMEOUT_S, procs=(proc,), poll_s=0.02)
        os.killpg(proc.pid, signal.SIGINT)
        assert stopped_status(proc, run_root) == 130
    finally:
        proc.kill()
    text = log.read_text()
    assert "stopped by a signal while loading its model or compiling its decoding step (it held no job)" in text, \
        text[-3000:]
    assert "decoding compiled in" not in text, text[-3000:]
    assert not pid_alive(read_json(run_root / "workers" / "dev1.json")["pid"])
    out = proc.stdout.read()  # the terminal: the PS's own last line (Ctrl-C does not stop what shows it), no more
    assert "ps WARNING [train] interrupted; no step trained yet" in out and "already stopping" not in out, out


def test_ctrl_c_before_the_ps_made_the_run_leaves_no_folder_behind(tmp_path):
    """Interrupted while the PS still imports, a launch leaves nothing that looks like a run (queue_tools used to
    call the folder of launch.lock and empty logs "not an asyncgrpo run directory" without saying why). Its
    processes are new interpreters (ASYNCGRPO_FORK=0), which import the libraries for seconds: a PS forked with them
    imported already can make the run before the signal lands."""
    run_root = tmp_path / "runs" / "new"
    proc = launch_in_group(run_root, "--workers", "1", "--max-steps", "10",
                           env={**OWN_SERVER_ENV, "ASYNCGRPO_FORK": "0"})
    try:
        wait_for(lambda: (run_root / "logs" / "log_parameter_server.txt").exists(), "the PS to start", TIMEOUT_S,
                 procs=(proc,), poll_s=0.01)
        os.killpg(proc.pid, signal.SIGINT)
        assert stopped_status(proc, run_root) == 130
    finally:
        proc.kill()
    out = proc.stdout.read()
    assert f"[launch] the run had not started: {run_root} removed" in out, out
    assert not (tmp_path / "runs").exists()


def test_a_folder_whose_ps_never_made_the_run_is_named_for_what_it_is(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "launch.lock").write_text("pid 1 on somehost\n")
    with pytest.raises(RunDirError, match=r"no queue/ and done/ inside\): a launch.sh started there and its "
                                          r"parameter server has not made them \(it is starting, was interrupted"):
        RunDir.open(tmp_path)


SLOW_REWARD_PY = """\
import time
from pathlib import Path


def slow(completions, **kwargs):
    (Path(__file__).parent / "scoring").touch()
    time.sleep(600)
    return [0.0] * len(completions)
"""


def test_a_second_ctrl_c_kills_what_the_first_ones_stop_waits_for(tmp_path):
    """The first Ctrl-C lets a worker finish the job in hand, at most 30 s; a reward that takes longer is waited
    for. A second Ctrl-C kills it at once, saying so; its job is still in processing/, for the next start's
    recovery."""
    folder = write_user_folder(tmp_path / "user")
    (folder / "rewards.py").write_text(SLOW_REWARD_PY)
    run_root = tmp_path / "run"
    proc = launch_in_group(run_root, "--workers", "1", "--max-steps", "10", "--model_name_or_path", "mymodel",
                           "--dataset_name", "data", "--reward_funcs", "rewards:slow", "--num_generations", "4",
                           "--per_device_train_batch_size", "4", "--max_completion_length", "4", cwd=folder)
    try:
        wait_for(lambda: (folder / "scoring").exists(), "the worker to score its first job", TIMEOUT_S,
                 procs=(proc,))
        worker = read_json(run_root / "workers" / "dev1.json")["pid"]
        os.killpg(proc.pid, signal.SIGINT)
        ps = read_json(run_root / "ps.json")["pid"]
        wait_for(lambda: not pid_alive(ps), "the PS to stop", TIMEOUT_S)  # launch.sh now waits for the worker
        assert pid_alive(worker)
        os.killpg(proc.pid, signal.SIGINT)
        assert stopped_status(proc, run_root, timeout=20) == 130  # not the 30 s the first stop allows
    finally:
        proc.kill()
    out = proc.stdout.read()
    assert "interrupted: stopping the parameter server and the workers (Ctrl-C again: kill them now)" in out, out
    assert "interrupted again: killing them now" in out, out
    assert not pid_alive(worker)
    assert list((run_root / "queue").glob("*_processing_*")), "the killed worker's job is not left for recovery"
