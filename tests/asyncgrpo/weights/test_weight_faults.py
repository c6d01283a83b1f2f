"""Faults on the weight path, with real processes: a reader stopped (SIGSTOP) while it holds
a slot's lock, a PS that dies in the middle of an in-place rewrite, a SIGKILLed PS whose
/dev/shm buffers ``queue_tools cleanup`` frees, and the broken-GPU error classifier.
The cuda_ipc variants run only where CUDA is.

This file is also the script its subprocesses run:
    python tests/asyncgrpo/weights/test_weight_faults.py stuck_reader RUN DEVICE
    python tests/asyncgrpo/weights/test_weight_faults.py die_mid_rewrite RUN
    python tests/asyncgrpo/weights/test_weight_faults.py publish_and_wait RUN
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch
from helpers import fill, held_values, start_script, wait_for, wait_until_stopped

from asyncgrpo.run import RunDir
from asyncgrpo.weights import make_publisher, make_subscriber, read_version_file
from asyncgrpo.weights.base import lock_holders, lock_path, open_lock
from asyncgrpo.weights.buffer_folders import SHM_ROOT, remove_dead_folders

HERE = Path(__file__).resolve()
PROC_TIMEOUT_S = 120
SLOT_WAIT_S = 2.0  # the publisher's bound in these tests (the default is longer)
BLOCKED_AFTER_S = 30.0  # past the bound by this much, a publish or close counts as blocked
CUDA = torch.cuda.is_available()
TRANSPORTS = [pytest.param("mmap", "cpu", id="mmap"),
              pytest.param("cuda_ipc", "cuda", id="cuda_ipc", marks=[
                  pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")])]


def mixed_model(device: str = "cpu") -> torch.nn.Module:
    """fp32 and bf16 parameters in one model (bf16 holds small integers exactly)."""
    m = torch.nn.Module()
    m.wide = torch.nn.Linear(64, 128)
    m.narrow = torch.nn.Linear(128, 32).to(torch.bfloat16)
    return m.to(device)


def run_script(*args: str, **popen) -> subprocess.Popen:
    return start_script(HERE, *args, **popen)


def within(seconds: float, fn, *args):
    """Runs fn in a thread; fails (instead of hanging the test) when it has not returned in time."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn(*args)
        except BaseException as err:  # re-raised in the test's thread
            out["error"] = err

    thread = threading.Thread(target=call, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} did not return within {seconds}s (blocked on a lock?)"
    if "error" in out:
        raise out["error"]
    return out.get("value"), time.monotonic() - started


def start_stuck_reader(run: RunDir, device: str) -> subprocess.Popen:
    """A reader process that stops itself while holding the lock of the slot it copies from."""
    proc = run_script("stuck_reader", str(run.root), device)
    assert proc.stdout.readline().strip() == "holding"
    wait_until_stopped(proc, PROC_TIMEOUT_S)
    return proc


def resume(proc: subprocess.Popen) -> dict:
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=PROC_TIMEOUT_S)
    assert proc.returncode == 0, out
    return json.loads(out)


# ---------------------------------------------------------------- a reader stopped holding a lock

@pytest.mark.process
@pytest.mark.parametrize("transport, device", TRANSPORTS)
def test_publish_goes_around_a_reader_stopped_holding_a_slot(run, caplog, transport, device):
    ps_model, worker_model = mixed_model(device), mixed_model(device)
    fill(ps_model, 1)
    publisher = make_publisher(run, ps_model, transport)
    publisher.slot_wait_s = SLOT_WAIT_S
    reader = make_subscriber(run)
    stuck = None
    try:
        assert publisher.publish(1, 1) and read_version_file(run)["buffer"] == 0
        stuck = start_stuck_reader(run, device)
        assert lock_holders(lock_path(run, 0)) == [stuck.pid]

        fill(ps_model, 2)  # into slot 1: the stopped reader holds slot 0 only
        assert within(SLOT_WAIT_S + BLOCKED_AFTER_S, publisher.publish, 2, 2)[0] is True
        assert read_version_file(run)["buffer"] == 1
        assert reader.sync(worker_model) == 2 and held_values(worker_model) == [2.0]

        fill(ps_model, 3)  # slot 0 is next: wait for it at most SLOT_WAIT_S, then rewrite slot 1 in place
        published, took = within(SLOT_WAIT_S + BLOCKED_AFTER_S, publisher.publish, 3, 3)
        assert published is True and took >= SLOT_WAIT_S
        info = read_version_file(run)
        assert (info["version"], info["buffer"], info["rewriting"]) == (3, 1, False)
        assert f"slot 0: its lock has been held for over {SLOT_WAIT_S:.1f} s by pid(s) [{stuck.pid}]" in caplog.text
        assert reader.sync(worker_model) == 3 and held_values(worker_model) == [3.0]

        fill(ps_model, 4)  # slot 0 is known to be held: one try, no second wait
        published, took = within(SLOT_WAIT_S + BLOCKED_AFTER_S, publisher.publish, 4, 4)
        assert published is True and took < SLOT_WAIT_S
        assert read_version_file(run)["buffer"] == 1
        assert reader.sync(worker_model) == 4 and held_values(worker_model) == [4.0]

        # Resumed, the stopped reader finishes its copy of version 1: nobody rewrote slot 0.
        assert resume(stuck) == {"version": 1, "values": [1.0]}
        stuck = None
        fill(ps_model, 5)
        assert publisher.publish(5, 5) and read_version_file(run)["buffer"] == 0  # back to alternating
        assert "slot 0 is free again" in caplog.text
        assert reader.sync(worker_model) == 5 and held_values(worker_model) == [5.0]
    finally:
        if stuck is not None:
            stuck.kill()
            stuck.communicate()
        publisher.close()
        reader.close()


@pytest.mark.process
@pytest.mark.parametrize("transport, device", TRANSPORTS)
def test_close_returns_while_a_stopped_reader_holds_a_slot(run, caplog, transport, device):
    ps_model = mixed_model(device)
    fill(ps_model, 6)
    publisher = make_publisher(run, ps_model, transport)
    publisher.slot_wait_s = SLOT_WAIT_S
    assert publisher.publish(1, 1)
    stuck = start_stuck_reader(run, device)
    try:
        within(SLOT_WAIT_S + BLOCKED_AFTER_S, publisher.close)
        assert read_version_file(run)["closed"]
        assert "closing while slot(s) [0] are held" in caplog.text
        if transport == "mmap":
            assert not publisher.dir.exists()  # freed: the stopped reader's mapping keeps its pages
        # What it copies when it resumes is still version 1, not freed or reused memory.
        assert resume(stuck) == {"version": 1, "values": [6.0]}
    finally:
        if stuck.poll() is None:
            stuck.kill()
            stuck.communicate()


@pytest.mark.process
def test_a_ps_dying_mid_rewrite_leaves_nothing_torn_to_read(run):
    """Slot 1 is held (by this test), so the PS's second publish rewrites slot 0 in place;
    it dies halfway through that copy. Readers must not take the half-written slot."""
    holder = open_lock(run, 1)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        proc = run_script("die_mid_rewrite", str(run.root))
        out, _ = proc.communicate(timeout=PROC_TIMEOUT_S)
        assert proc.returncode == 17, out
    finally:
        os.close(holder)
    subscriber = make_subscriber(run)
    try:
        info = read_version_file(run)
        assert (info["version"], info["buffer"], info["rewriting"]) == (1, 0, True)
        worker_model = mixed_model()
        fill(worker_model, 9)
        assert subscriber.sync(worker_model) is None and held_values(worker_model) == [9.0]  # weights kept
        restarted = mixed_model()
        fill(restarted, 3)
        with closing(make_publisher(run, restarted)) as new:  # removes the dead PS's buffers too
            new.publish(1, 1)  # a restarted PS: readers take its weights
            assert subscriber.sync(worker_model) == 1 and held_values(worker_model) == [3.0]
    finally:
        subscriber.close()
        remove_dead_folders(run, (SHM_ROOT, run.weights))  # when the test failed before the restart


# ---------------------------------------------------------------- a SIGKILLed PS's buffers

@pytest.mark.process
def test_queue_tools_cleanup_frees_the_buffers_of_a_sigkilled_ps_only(run, capsys, caplog):
    from queue_tools.cli import main as queue_tools

    ps = run_script("publish_and_wait", str(run.root), stdin=subprocess.PIPE)
    try:
        folder = Path(json.loads(ps.stdout.readline())["dir"])
        assert folder.is_dir() and folder.parent == Path("/dev/shm")
        assert queue_tools(["cleanup", str(run.root)]) == 0
        assert capsys.readouterr().out.strip() == "cleanup: nothing to do" and folder.is_dir()  # its PS lives
    finally:
        ps.kill()
        ps.communicate()  # reaped: the pid is gone, not a zombie
    assert ps.returncode == -signal.SIGKILL and folder.is_dir()  # nobody removed it

    try:
        mb = sum(p.stat().st_blocks * 512 for p in folder.glob("slot*.bin")) / 1e6
        assert queue_tools(["cleanup", str(run.root), "--dry-run"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out == [f"would free 2 weight buffers of dead PS pid {ps.pid}: {mb:.1f} MB",
                       "cleanup: 1 action(s) (dry run: nothing changed)"]
        assert folder.is_dir()
        assert queue_tools(["cleanup", str(run.root)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out == [f"freed 2 weight buffers of dead PS pid {ps.pid}: {mb:.1f} MB", "cleanup: 1 action(s)"]
        assert not folder.exists()
        assert queue_tools(["cleanup", str(run.root), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["weight_buffers"] == []
        # A worker started now finds the version file naming the dead PS's buffers: it has synced nothing to keep.
        with caplog.at_level(logging.WARNING), closing(make_subscriber(run)) as fresh:
            assert fresh.sync(mixed_model()) is None
        assert "cannot open" in caplog.text and "keeping the weights it loaded (none synced yet)" in caplog.text
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # RAM, not disk: never left behind by a failed test


# ---------------------------------------------------------------- which errors mean "the GPU is broken"

def test_broken_device_errors_are_told_from_job_errors():
    from asyncgrpo.messages import first_line
    from asyncgrpo.weights.device_errors import is_broken_device_error, is_sticky_cuda_error

    illegal = torch.AcceleratorError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")
    assert is_broken_device_error(illegal) and is_sticky_cuda_error(illegal)
    assert first_line(illegal) == "AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert is_broken_device_error(RuntimeError("CUDA error: device-side assert triggered"))  # older torch
    assert is_broken_device_error(RuntimeError("CUDA error: invalid argument"))  # not sticky, still a restart
    assert not is_sticky_cuda_error(RuntimeError("CUDA error: invalid argument"))
    try:
        try:
            raise illegal
        except RuntimeError as err:
            raise ValueError("generation failed") from err
    except ValueError as wrapped:
        assert is_broken_device_error(wrapped)
    for job_error in (ValueError("bad prompt"), RuntimeError("shape mismatch"), KeyError("reward"),
                      torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                      torch.AcceleratorError("CUDA error: out of memory")):
        assert not is_broken_device_error(job_error), job_error


# ---------------------------------------------------------------- subprocess roles

def _stuck_reader_main(root: str, device: str) -> None:
    from asyncgrpo.weights import cuda_ipc, mmap_file

    def copy_then_stop(original):
        def copy_out(self, info, dsts, idx):
            print("holding", flush=True)  # under SH on the slot's lock
            os.kill(os.getpid(), signal.SIGSTOP)
            original(self, info, dsts, idx)
        return copy_out

    for reader in (mmap_file.MmapReader, cuda_ipc.CudaIpcReader):
        reader.copy_out = copy_then_stop(reader.copy_out)
    run = RunDir.open(root)
    model = mixed_model(device)
    subscriber = make_subscriber(run)
    version = subscriber.sync(model)
    subscriber.close()
    print(json.dumps({"version": version, "values": held_values(model)}), flush=True)


def _die_mid_rewrite_main(root: str) -> None:
    from asyncgrpo.weights import base

    run = RunDir.open(root)
    model = mixed_model()
    fill(model, 1)
    publisher = make_publisher(run, model, "mmap")
    publisher.slot_wait_s = 0.2
    publisher.publish(1, 1)  # slot 0; slot 1 is held by the test

    def half_then_die(dsts, srcs):
        base.copy_tensors(dsts[: len(dsts) // 2], srcs[: len(srcs) // 2])
        os._exit(17)

    publisher._copy = half_then_die
    fill(model, 2)
    publisher.publish(2, 2)


def _publish_and_wait_main(root: str) -> None:
    """A PS as far as /dev/shm is concerned: publishes once, then waits to be killed."""
    model = mixed_model()
    publisher = make_publisher(RunDir.open(root), model, "mmap")
    publisher.publish(1, 1)
    print(json.dumps({"dir": str(publisher.dir)}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    role, *argv = sys.argv[1:]
    {"stuck_reader": _stuck_reader_main, "die_mid_rewrite": _die_mid_rewrite_main,
     "publish_and_wait": _publish_and_wait_main}[role](*argv)


def test_a_reader_blocked_by_a_stopped_writer_says_what_it_waits_for_and_goes_on_after(tmp_path, caplog):
    # A PS stopped (SIGSTOP) while rewriting a slot holds its exclusive lock: the worker waits, saying so.
    from asyncgrpo.weights.base import flocked_patiently, open_lock

    run = RunDir.create(tmp_path / "run")
    writer, reader = open_lock(run, 0), open_lock(run, 0)  # two open files: two lock owners
    fcntl.flock(writer, fcntl.LOCK_EX)
    got = threading.Event()

    def read():
        with flocked_patiently(reader, fcntl.LOCK_SH, "the parameter server to finish writing slot 0",
                               report_every_s=0.05):
            got.set()

    thread = threading.Thread(target=read)
    thread.start()
    try:
        wait_for(lambda: "waiting" in caplog.text, "a line while blocked", 10, poll_s=0.01)
        assert not got.is_set()
        assert "[weights] waiting 0 s so far for the parameter server to finish writing slot 0" in caplog.text
    finally:
        fcntl.flock(writer, fcntl.LOCK_UN)
        thread.join(timeout=10)
        os.close(writer)
        os.close(reader)
    assert got.is_set()


def test_a_waiting_worker_says_what_it_waits_for_once_per_interval(caplog):
    from worker.loop import Waiting

    caplog.set_level("INFO", logger="asyncgrpo.worker")
    waiting = Waiting(2, report_every_s=0.0)
    waiting.waiting_for("the parameter server's first weights")  # starts the clock: nothing said yet
    waiting.waiting_for("the parameter server's first weights")
    waiting.waiting_for("a job from the parameter server")  # something else: its own clock
    waiting.over()
    waiting.waiting_for("a job from the parameter server")
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncgrpo.worker"]
    assert lines == ["[worker] dev2 has waited 0 s for the parameter server's first weights"]
