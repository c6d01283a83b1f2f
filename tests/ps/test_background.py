"""A PS background thread asked to stop (ps/background.py): a stop must end, also when the thread is stuck."""

import threading
import time

from helpers.pipelines import Stuck

from asyncgrpo import messages
from asyncgrpo.jobqueue import JobState, QueueWatcher


def test_a_thread_stuck_past_the_bound_is_left_behind_with_every_stack_logged(tmp_path, monkeypatch, caplog, capfd):
    monkeypatch.setattr(messages, "STOP_JOIN_S", 0.3)
    release = threading.Event()
    thread = Stuck(QueueWatcher(tmp_path, {JobState.PENDING}), release).start()
    try:
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="asyncgrpo.ps"):
            thread.stop()
        assert time.monotonic() - started < 10
        assert thread.thread.is_alive()
        assert [r.getMessage() for r in caplog.records] == [
            "[queue] the stuck loop did not stop within 0.3 s: left running (a daemon thread); every thread's stack "
            "follows"]
        assert "in _loop" in capfd.readouterr().err  # the stuck thread's frame, among the stacks
    finally:
        release.set()
        thread.thread.join(10)
