"""The heartbeat threads (asyncgrpo/run/liveness.py) are joined within a bound when their process stops: a heartbeat
write that never returns (a hung network filesystem) does not keep the PS or a worker from exiting."""

import threading

from asyncgrpo import messages
from asyncgrpo.run import RunDir, fileops
from asyncgrpo.run.liveness import PSHeartbeat, WorkerPresence


def stops(stop) -> bool:
    """Whether ``stop`` returns within 10 s, run on a thread of its own (a stop that hangs fails the test instead)."""
    stopping = threading.Thread(target=stop, daemon=True)
    stopping.start()
    stopping.join(10)
    return not stopping.is_alive()


def test_a_heartbeat_stuck_in_its_write_does_not_keep_the_ps_from_stopping(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(messages, "STOP_JOIN_S", 0.3)
    writing, release = threading.Event(), threading.Event()

    def touch_that_hangs(path):
        writing.set()
        release.wait()

    run = RunDir.create(tmp_path / "run")
    monkeypatch.setattr(fileops, "touch", touch_that_hangs)
    heartbeat = PSHeartbeat(run)
    try:
        with caplog.at_level("WARNING"):
            heartbeat.__enter__()
            assert writing.wait(10)
            assert stops(lambda: heartbeat.__exit__(None, None, None)), "the PS heartbeat's stop waits for its write"
        assert any("the PS heartbeat did not stop within 0.3 s" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        heartbeat._thread.join(10)


def test_a_worker_heartbeat_stuck_in_its_write_does_not_keep_the_worker_from_stopping(tmp_path, monkeypatch, caplog):
    """Its stop skips the last beat (which would wait for the same write) and still releases the worker's lock."""
    monkeypatch.setattr(messages, "STOP_JOIN_S", 0.3)
    writing, release = threading.Event(), threading.Event()
    run = RunDir.create(tmp_path / "run")
    presence = WorkerPresence(run, 1, interval_s=0.01).start()  # (its first beat written as usual)

    def write_that_hangs(path, data):
        writing.set()
        release.wait()

    monkeypatch.setattr(fileops, "write_json", write_that_hangs)
    try:
        with caplog.at_level("WARNING"):
            assert writing.wait(10)
            assert stops(presence.stop), "the worker's stop waits for its heartbeat's stuck write"
        assert any("dev1's heartbeat did not stop within 0.3 s" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        presence._thread.join(10)
    monkeypatch.undo()
    WorkerPresence(run, 1, lease_s=0.0).start().stop()  # its lock was released: another worker can take dev1
