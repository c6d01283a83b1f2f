"""A write that hits a full disk leaves no partial file under a final name and raises
QueueWriteError; a worker's failed complete() leaves its job recoverable; the heartbeat
thread outlives an OSError. ENOSPC is injected, and also produced by a real tiny tmpfs.

No sleeps: bounded waits only (Event.wait / Thread.join with a timeout).
"""

import errno
import logging
import os
import threading

import pytest
import torch
from helpers import entries, inject_disk_full, tmpfs

from asyncgrpo.jobqueue import JobQueue, QueueName, make_job_id
from asyncgrpo.run import QueueWriteError, RunDir, WorkerPresence, fileops

BAD = make_job_id(1, 0)  # the job whose write hits the full disk
GOOD = make_job_id(2, 0)
LOGGER = "asyncgrpo.queue"
WAIT_S = 5.0  # bound on every wait for another thread (a healthy call takes milliseconds)


def pending_name(job_id):
    return QueueName(job_id).filename


def queue_logs(caplog, level=logging.WARNING):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= level]


# --------------------------------------------------------------------------- full disk


def assert_disk_full_error(err, code=errno.ENOSPC):
    assert isinstance(err, QueueWriteError)
    assert err.errno == code
    assert "disk full" in str(err) and os.strerror(code) in str(err), str(err)


@pytest.mark.parametrize("where", ["write", "quota", "fsync"])
def test_put_job_on_a_full_disk_publishes_nothing(where, tmp_path, monkeypatch):
    q = JobQueue(RunDir.create(tmp_path / "run"))
    big = torch.arange(50_000, dtype=torch.float32)  # 200 KB
    with monkeypatch.context() as m:
        state = inject_disk_full(m, q.run, where)
        with pytest.raises(QueueWriteError) as info:
            q.put_job(BAD, {"tensor": big}, created_step=1)
    assert state["failed"] == 1
    assert_disk_full_error(info.value, errno.EDQUOT if where == "quota" else errno.ENOSPC)
    assert entries(q.run.queue) == set(), "a file appeared under a final name"
    assert os.listdir(q.run.tmp) == [], "the partial temp file was left behind"
    assert q.claim(1) is None

    # The disk has room again: the same job id is free and goes through whole.
    q.put_job(BAD, {"tensor": big}, created_step=1)
    job = q.claim(1)
    assert job.job_id == BAD and torch.equal(job.data["tensor"], big)


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_complete_on_a_full_disk_keeps_the_job_recoverable(where, tmp_path, monkeypatch, caplog):
    run = RunDir.create(tmp_path / "run")
    ps, worker = JobQueue(run), JobQueue(run)
    ps.put_job(BAD, {"prompt": "1:"}, created_step=1)
    presence = WorkerPresence(run, 1, interval_s=3600).start()
    try:
        job = worker.claim(1)
        presence.update(job_id=job.job_id, state="busy")
        presence.beat()  # what the next heartbeat tick writes
        with monkeypatch.context() as m:
            state = inject_disk_full(m, run, where)
            with pytest.raises(QueueWriteError) as info:
                worker.complete(job, {"text": "x" * 100_000}, weights_version=0)
        assert state["failed"] == 1
        assert_disk_full_error(info.value)
        assert entries(run.queue) == {job.path.name}, "the processing file must stay for recovery"
        assert job.path.name == f"{BAD}_processing_by_dev1.pt"
        assert os.listdir(run.tmp) == []
        assert os.listdir(run.done) == []
        assert ps.collect() == []
        assert ps.recover() == [], "a live worker's job must not be recovered"
    finally:
        presence.stop()

    actions = ps.recover()
    assert [(a.what, a.src, a.dst) for a in actions] == [("requeue", job.path.name, f"{BAD}_pending_a2.pt")]
    assert entries(run.queue) == {f"{BAD}_pending_a2.pt"}

    job2 = worker.claim(2)
    assert (job2.job_id, job2.attempt) == (BAD, 2)
    assert worker.complete(job2, {"text": "done"}, weights_version=0)
    results = ps.collect()
    assert [(r.job_id, r.attempt, r.data) for r in results] == [(BAD, 2, {"text": "done"})]


@pytest.mark.parametrize("outcome", ["complete", "fail"])
def test_a_link_after_the_fence_that_fails_gives_the_job_back_to_its_worker(outcome, tmp_path, monkeypatch):
    # The result is staged and the job fenced; then the link into queue/ fails (a full directory block).
    run = RunDir.create(tmp_path / "run")
    ps, worker = JobQueue(run), JobQueue(run)
    ps.put_job(BAD, {"prompt": "1:"}, created_step=1)
    job = worker.claim(1)
    real_link = os.link

    def link(src, dst, *args, **kwargs):
        if os.path.dirname(os.fspath(dst)) == str(run.queue):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_link(src, dst, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(fileops.os, "link", link)
        with pytest.raises(QueueWriteError) as info:
            if outcome == "complete":
                worker.complete(job, {"text": "x"}, weights_version=0)
            else:
                worker.fail(job, {"type": "ValueError"}, max_attempts=3, weights_version=0)
    assert_disk_full_error(info.value)
    # No temp file left, nothing archived, and the job is its worker's again (processing), not stuck fenced.
    assert os.listdir(run.tmp) == [] and os.listdir(run.done) == []
    assert entries(run.queue) == {job.path.name}
    assert worker.release(job)  # what the worker does with a job whose outcome it cannot write
    again = worker.claim(2)
    assert (again.job_id, again.attempt) == (BAD, 1)
    assert worker.complete(again, {"text": "done"}, weights_version=0)
    assert [(r.job_id, r.data) for r in ps.collect()] == [(BAD, {"text": "done"})]


# A real full filesystem: a 64 KiB tmpfs.

def _free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_put_job_on_a_really_full_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    with tmpfs(mnt, "64k"):
        q = JobQueue(RunDir.create(mnt / "run"))
        filler = mnt / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (_free_bytes(mnt) - 8192))  # leaves two pages
        left = _free_bytes(mnt)
        assert 0 < left <= 8192

        for job_id, tensor in [(BAD, torch.arange(50_000, dtype=torch.float32)),  # 200 KB: never fits
                               (GOOD, torch.arange(10_000, dtype=torch.float32))]:  # 40 KB: fits once freed
            with pytest.raises(QueueWriteError) as info:
                q.put_job(job_id, {"tensor": tensor}, created_step=int(job_id[:6]))
            assert_disk_full_error(info.value)
            assert entries(q.run.queue) == set(), "a file appeared under a final name"
            assert os.listdir(q.run.tmp) == [], "the partial temp file was left behind"
            assert _free_bytes(mnt) == left, "the partial temp file's space was not given back"

        filler.unlink()
        small = torch.arange(10_000, dtype=torch.float32)
        q.put_job(GOOD, {"tensor": small}, created_step=2)
        assert entries(q.run.queue) == {pending_name(GOOD)}
        job = q.claim(1)
        assert job.job_id == GOOD and torch.equal(job.data["tensor"], small)


# --------------------------------------------------------------------------- heartbeat


def test_heartbeat_thread_survives_oserror(tmp_path, monkeypatch, caplog):
    run = RunDir.create(tmp_path / "run")
    presence = WorkerPresence(run, 3, interval_s=0.01).start()
    heartbeat = run.workers / "dev3.json"
    real_write_json = fileops.write_json
    state = {"calls": 0}
    recovered = threading.Event()

    def flaky(path, obj, **kw):
        state["calls"] += 1
        if state["calls"] <= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write_json(path, obj, **kw)
        recovered.set()

    try:
        first = fileops.read_json(heartbeat)["last_beat"]
        monkeypatch.setattr(fileops, "write_json", flaky)
        assert recovered.wait(WAIT_S), "the heartbeat never beat again after the OSError"
        assert any(t.name == "heartbeat-dev3" and t.is_alive() for t in threading.enumerate())
        assert fileops.read_json(heartbeat)["last_beat"] > first
        failures = [m for m in queue_logs(caplog) if "heartbeat failed" in m]
        assert len(failures) == 3 and all("[queue]" in m and "dev3" in m for m in failures)
    finally:
        presence.stop()
    assert not any(t.name == "heartbeat-dev3" for t in threading.enumerate())
    assert fileops.read_json(heartbeat)["state"] == "stopped"


@pytest.mark.parametrize("fails", ["write", "fsync", "rename"])
def test_a_status_file_whose_write_fails_leaves_no_temp_file(tmp_path, monkeypatch, fails):
    # A heartbeat rewrites its file every second: one temp file left per failed write would pile up on a full disk.
    path = tmp_path / "dev1.json"
    fileops.write_json(path, {"beat": 1})
    disk_full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def failing(*_args):
        raise disk_full

    monkeypatch.setattr(fileops if fails == "write" else os, {"write": "_write_all", "fsync": "fsync",
                                                             "rename": "replace"}[fails], failing)
    for _ in range(3):
        with pytest.raises(OSError) as raised:
            fileops.write_json(path, {"beat": 2}, fsync=True)
        assert raised.value.__cause__ is disk_full and raised.value.filename == str(path)  # it names the file
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["dev1.json"]
    assert fileops.read_json(path) == {"beat": 1}
