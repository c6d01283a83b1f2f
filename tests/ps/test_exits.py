"""Why the PS stops, in one line: a crash's first cause (a full disk: which file, how much is free), a relaunch
whose model does not fit the run's checkpoints, and a disk too small for one checkpoint, refused up front."""

import errno
import re
import shutil
import subprocess
from collections import namedtuple

import pytest
from helpers import (
    LEDGER_FILE,
    PROCESS_ENV,
    PYTHON,
    REPO,
    assert_exactly_once,
    demo_flags,
    expect_exit,
    metrics,
    run_flags,
    start_faulty_ps,
    start_process,
    tmpfs,
)

from asyncgrpo.config import ConfigError
from asyncgrpo.run import RunDir
from asyncgrpo.run.liveness import PSAlreadyRunning, PSRunLock
from asyncgrpo.run.rundir import PSStatus
from asyncgrpo.tasks.demo import build_model, write_demo_model
from asyncgrpo.weights.snapshot import snapshot_dir
from ps.exits import check_disk_for_checkpoints, checkpoint_misfit, first_cause

Usage = namedtuple("Usage", "total used free")


def test_the_first_cause_of_a_crash_is_the_one_named(tmp_path):
    state = tmp_path / "checkpoint-200" / "trainer_state.json"
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(state))
        except OSError:
            raise OSError(errno.EBADF, "Bad file descriptor")  # noqa: B904 (a second error while unwinding the first)
    except OSError as err:
        crash = err
    line = first_cause(crash)
    assert line.startswith(f"no space left on the disk writing {state} (") and "MB free there)" in line, line
    assert "Bad file descriptor" not in line
    assert first_cause(ValueError("bad\nsecond line")) == "ValueError: bad"


def test_a_checkpoint_of_another_model_is_named_with_what_differs_and_the_flag_to_pass():
    small, large = build_model(hidden_size=64), build_model(hidden_size=32)
    with pytest.raises(RuntimeError) as refused:
        large.load_state_dict(small.state_dict())  # what resuming does with the checkpoint's tensors
    previous = PSStatus(pid=1, host="h", model="/runs/r/demo_model", state="finished", started_at=0.0)
    misfit = checkpoint_misfit(refused.value, "/runs/r/checkpoints/checkpoint-8", "/models/other", previous)
    assert isinstance(misfit, ConfigError)
    message = str(misfit)
    assert "\n" not in message
    assert message.startswith("checkpoint-8 does not fit --model_name_or_path /models/other (size mismatch for ")
    assert message.endswith("this run was trained from /runs/r/demo_model: relaunch with --model_name_or_path "
                            "/runs/r/demo_model, or start a new run with another --run_dir")
    assert checkpoint_misfit(RuntimeError("CUDA out of memory"), "c", "m", previous) is None


def test_a_disk_too_small_for_one_checkpoint_is_refused_before_training(tmp_path, monkeypatch, run):
    model = build_model()
    params = sum(p.numel() for p in model.parameters())
    needed_mb = 3 * 4 * params / 1e6  # float32 weights and AdamW's two moments
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, 0, int(needed_mb * 0.9 * 1e6)))
    with pytest.raises(ConfigError) as refused:
        check_disk_for_checkpoints(run, model, saves_checkpoints=True)
    assert f"{run.checkpoints} has " in str(refused.value) and f"needs about {needed_mb:,.1f} MB" in str(refused.value)
    check_disk_for_checkpoints(run, model, saves_checkpoints=False)  # no checkpoints: nothing to hold
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, 0, int(needed_mb * 1.1 * 1e6)))
    check_disk_for_checkpoints(run, model, saves_checkpoints=True)
    for p in model.parameters():  # a LoRA-like run: only a few parameters trained, so much less is needed
        p.requires_grad_(p.dim() == 1)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, 0, int(needed_mb * 0.2 * 1e6)))
    check_disk_for_checkpoints(run, model, saves_checkpoints=True)


def test_a_ps_on_a_full_disk_holds_its_lock_without_writing_who_it_is(monkeypatch, run):
    """The lock file's "pid P on HOST" is a courtesy for a refused second PS: a full disk must not turn a relaunch
    into a traceback before the disk check can say what is wrong (seen: a worker filled the freed block first)."""
    import os

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    lock = PSRunLock(run)
    try:
        with pytest.raises(PSAlreadyRunning, match="its pid not written yet"):
            PSRunLock(run, record=False)
    finally:
        lock.release()


@pytest.mark.process
def test_a_finished_run_relaunched_with_another_model_stops_with_one_line(finished_demo_run, tmp_path):
    run_root = tmp_path / "run"
    shutil.copytree(finished_demo_run, run_root, ignore=shutil.ignore_patterns("report"))
    other = write_demo_model(tmp_path / "other_model", hidden_size=32)
    ps = subprocess.run([PYTHON, "-m", "ps", "--run_dir", str(run_root), *demo_flags(), "--max_steps", "8",
                         "--model_name_or_path", other], cwd=REPO, env=PROCESS_ENV, capture_output=True, text=True,
                        timeout=600)
    assert ps.returncode == 2, ps.stderr[-3000:]
    errors = [line for line in ps.stderr.splitlines() if line.startswith("ps: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"ps: error: checkpoint-8 does not fit --model_name_or_path {other} (size mismatch for "), ps.stderr[-3000:]
    assert f"this run was trained from {finished_demo_run.resolve() / 'demo_model'}" in errors[0]
    assert "Traceback" not in ps.stderr


@pytest.mark.process
def test_a_disk_that_fills_while_training_stops_the_ps_with_one_line_and_a_relaunch_says_why(tmp_path):
    """A real 1.8 MB disk: the demo model (0.3 MB) and checkpoint-2 (0.9 MB) fit, checkpoint-4 does not. The PS
    stops with one line naming the full disk, frees its weight buffers, and a relaunch on that disk refuses up
    front, with the space a checkpoint needs, instead of training to the same failure."""
    disk = tmp_path / "disk"
    disk.mkdir()
    flags = run_flags(12, save_steps=2)
    with tmpfs(disk, "1800k"):
        root = disk / "run"
        ps = start_process(root, tmp_path / "ps.log", "ps", *flags)
        worker = start_process(root, tmp_path / "w1.log", "worker", "--device", "1", *flags)
        try:
            expect_exit(ps, 1, tmp_path / "ps.log", 600)
            relaunch = subprocess.run([PYTHON, "-m", "ps", "--run_dir", str(root), *flags], cwd=REPO,
                                      env=PROCESS_ENV, capture_output=True, text=True, timeout=600)
        finally:
            worker.terminate()
            worker.wait(timeout=120)
        checkpoints = sorted(p.name for p in (root / "checkpoints").glob("checkpoint-*"))
    log = (tmp_path / "ps.log").read_text()
    [error] = [line for line in log.splitlines() if line.startswith("ps: error:")]
    assert "no space left on the disk writing " in error or f"the disk of {root} is full" in error, error
    assert error.endswith("free some space and relaunch (training resumes from the last checkpoint)"), error
    assert "checkpoint-2" in checkpoints
    assert relaunch.returncode == 2, relaunch.stderr[-3000:]
    [refusal] = [line for line in relaunch.stderr.splitlines() if line.startswith("ps: error:")]
    assert refusal.startswith(f"ps: error: {root / 'checkpoints'} has "), refusal
    assert "a checkpoint of this model needs about" in refusal


@pytest.mark.process
def test_a_full_disk_at_each_small_write_stops_the_ps_with_one_line_and_a_relaunch_loses_nothing(tmp_path):
    """The disk is full for one write of each kind in turn, in three lives of the PS on one run (the fault is
    injected: tests/processes/faulty_ps.py): a metrics line, a checkpoint's ledger, a weights snapshot. Each life stops
    with one line naming the file; the fourth finishes, each step and each job trained once, no temp file left."""
    root = tmp_path / "run"
    flags = [*run_flags(8, save_steps=2), "--weight_transport", "safetensors"]
    worker = start_process(root, tmp_path / "w1.log", "worker", "--device", "1", *flags)
    lines = []
    try:
        faults = [("full-metrics", 3, re.escape(str(root / "metrics.jsonl"))),
                  ("full-ledger", 4, re.escape(str(root / "checkpoints" / "checkpoint-4" / LEDGER_FILE))),
                  ("full-snapshot", 4, re.escape(str(snapshot_dir(RunDir(root)))) + r"/[vd]00000004\.safetensors")]
        for life, (fault, arg, file) in enumerate(faults):
            log = tmp_path / f"ps{life}.log"
            ps = start_faulty_ps(root, log, fault, arg, *flags)
            expect_exit(ps, 1, log, 600)
            [error] = [line for line in log.read_text().splitlines() if line.startswith("ps: error:")]
            lines.append(error)
            assert re.match(f"ps: error: no space left on the disk writing {file} \\(", error), error  # anchor or delta
        ps = start_process(root, tmp_path / "ps_last.log", "ps", *flags)
        expect_exit(ps, 0, tmp_path / "ps_last.log", 600)
    finally:
        worker.terminate()
        worker.wait(timeout=120)
    # Lives 2-4 resumed from checkpoint-2: the ledger's checkpoint-4 never completed, and the third life stopped
    # before it could save one.
    assert [m["step"] for m in metrics(root)] == list(range(1, 9))
    assert_exactly_once(root, jobs=8)
    assert [p.name for p in root.rglob("*.tmp") if p.is_file()] == []  # no temp file left by a failed write
