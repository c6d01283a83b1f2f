"""The PS stops its pipeline's threads twice on the way out (ps/trainer.py: train's finally, then close): a thread
stuck past the bound costs that bound once, not twice (ps/background.py)."""

import threading
import time

from helpers.pipelines import Stuck

from asyncgrpo import messages
from asyncgrpo.jobqueue import JobState, QueueWatcher

BOUND_S = 1.0


def test_a_stuck_thread_is_waited_for_once_however_often_it_is_stopped(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(messages, "STOP_JOIN_S", BOUND_S)
    release = threading.Event()
    thread = Stuck(QueueWatcher(tmp_path, {JobState.PENDING}), release).start()
    try:
        with caplog.at_level("WARNING", logger="asyncgrpo.ps"):
            thread.stop()
            started = time.monotonic()
            thread.stop()
            again_s = time.monotonic() - started
        assert thread.thread.is_alive()
        assert again_s < BOUND_S / 2, f"the second stop waited {again_s:.2f} s for the thread again"
        assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    finally:
        release.set()
        thread.thread.join(10)
