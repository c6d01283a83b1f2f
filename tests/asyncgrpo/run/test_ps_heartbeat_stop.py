"""The PS's heartbeat thread (asyncgrpo/run/liveness.py) is joined within a bound when the PS stops: a heartbeat write
that never returns (a hung network filesystem) does not keep the PS from exiting."""

import threading

from asyncgrpo import messages
from asyncgrpo.run import RunDir, fileops
from asyncgrpo.run.liveness import PSHeartbeat


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
            stopping = threading.Thread(target=heartbeat.__exit__, args=(None, None, None), daemon=True)
            stopping.start()  # (on a thread of its own: a stop that hangs fails the test instead)
            stopping.join(10)
            assert not stopping.is_alive(), "the PS heartbeat's stop waits for its stuck write"
        assert any("the PS heartbeat did not stop within 0.3 s" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        heartbeat._thread.join(10)
