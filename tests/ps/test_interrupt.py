"""The PS's interrupt (SIGINT, SIGTERM, SIGHUP: ps/__main__.py) stops training whatever the trainer is doing when the
signal comes: a KeyboardInterrupt raised where it would leave a lock held is put off to the trainer's next safe
point, and one that never reaches the training loop is raised there again (ps/pipeline.py)."""

import signal
import sys
import threading
import time

import pytest
from helpers.pipelines import make_pipeline

import ps.__main__ as ps_main
from asyncgrpo.jobqueue import JobState, QueueWatcher

WAIT_S = 10.0


@pytest.fixture
def interrupt_handlers():
    """The PS's handlers for SIGINT, SIGTERM and SIGHUP while the test runs; the process's own ones after it."""
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {signum: signal.getsignal(signum) for signum in stops}
    for signum in stops:
        signal.signal(signum, ps_main._interrupt)
    yield ps_main.INTERRUPTED
    for signum, handler in before.items():
        signal.signal(signum, handler)
    ps_main.INTERRUPTED.clear()
    ps_main._put_off = None


def test_a_signal_that_comes_as_the_trainer_wakes_the_producer_leaves_no_lock_held(tmp_path, interrupt_handlers):
    """The trainer wakes the producer thread every step (QueueWatcher.wake: Event.set, which takes the event's lock
    inside threading's Condition.__enter__ and protects it only once that returns). A signal handled right there, as
    when it comes while the trainer waits for that lock, must not raise KeyboardInterrupt: the lock would stay held,
    and the stop, which wakes the producer through the same event (WatchedThread.stop), would wait for it forever."""
    watcher = QueueWatcher(tmp_path, {JobState.PROCESSING}, use_events=False)
    main = threading.get_ident()
    holding = threading.Event()

    def signal_while_the_trainer_waits_for_the_lock():
        with watcher._wake._cond:  # what the producer thread holds for a moment when it waits or clears the event
            holding.set()
            deadline = time.monotonic() + WAIT_S
            while sys._current_frames()[main].f_code is not threading.Condition.__enter__.__code__:
                assert time.monotonic() < deadline, "the trainer never waited for the event's lock"
                time.sleep(0.001)
            # The signal's C handler runs on this thread, so the trainer's wait for the lock goes on; the trainer
            # handles the signal as soon as it has the lock, still inside Condition.__enter__.
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    holder = threading.Thread(target=signal_while_the_trainer_waits_for_the_lock)
    holder.start()
    holding.wait(WAIT_S)
    try:
        watcher.wake()  # the trainer's wake of the producer
    except KeyboardInterrupt:
        pass  # (raised inside the lock's __enter__: the lock is left held, which the stop below finds)
    holder.join(WAIT_S)
    stop = threading.Thread(target=watcher.wake, daemon=True)  # what WatchedThread.stop does first
    stop.start()
    stop.join(WAIT_S)
    assert not stop.is_alive(), "the event's lock stayed held: the stop waits for it forever"
    assert interrupt_handlers.is_set()
    # Put off, not lost: the next signal raises it (launch.sh's SIGTERM follows a Ctrl-C), as the trainer does at
    # its next safe point.
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGTERM)


def next_batch_within(pipeline, seconds: float) -> dict:
    """What ends ``pipeline.next_batch(0)`` within ``seconds`` (``{"error": ...}``; ``{}``: it still waits)."""
    outcome = {}

    def ask():
        try:
            pipeline.next_batch(0)
        except BaseException as err:  # noqa: BLE001 - what ended the wait is the outcome
            outcome["error"] = err

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(seconds)
    return outcome


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the lost KeyboardInterrupt)
def test_training_that_goes_on_after_the_interrupt_stops_at_the_next_batch(run, interrupt_handlers):
    """A KeyboardInterrupt swallowed before it reaches the training loop (one raised inside a finalizer is only
    printed) must not leave the PS training: the later signals only log. The trainer raises it again when it asks
    for the next batch, and within a second while it waits for one."""

    class Finalized:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # its KeyboardInterrupt is raised here, and lost
            len("")  # (the handler runs at this call)

    Finalized()
    assert interrupt_handlers.is_set() and signal.getsignal(signal.SIGINT) is ps_main._already_stopping
    pipeline = make_pipeline(run, poll_only="true")
    pipeline.start(None, published_version=0)
    try:
        pipeline.interrupted = interrupt_handlers
        assert isinstance(next_batch_within(pipeline, WAIT_S).get("error"), KeyboardInterrupt)
        pipeline.interrupted = threading.Event()
        waiting = threading.Timer(0.2, pipeline.interrupted.set)  # set while next_batch waits (no worker runs)
        waiting.start()
        assert isinstance(next_batch_within(pipeline, WAIT_S).get("error"), KeyboardInterrupt)
    finally:
        pipeline.stop()


def test_the_signal_that_follows_a_ctrl_c_at_once_is_not_warned_of(interrupt_handlers, caplog, monkeypatch):
    """A terminal's Ctrl-C reaches the PS, then launch.sh's SIGTERM: one request to stop, not a second one to warn
    of ("already stopping ... SIGKILL to force"). A signal seconds later is one, and says so."""
    with caplog.at_level("INFO", logger="asyncgrpo.ps"), pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    with caplog.at_level("INFO", logger="asyncgrpo.ps"):
        signal.raise_signal(signal.SIGTERM)
        monkeypatch.setattr(ps_main, "_first_signal_at", time.monotonic() - ps_main.ONE_STOP_S)
        signal.raise_signal(signal.SIGTERM)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "already stopping" in r.getMessage()]
    assert [level for level, _ in said] == ["INFO", "WARNING"], said
