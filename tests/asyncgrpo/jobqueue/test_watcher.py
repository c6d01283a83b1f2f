"""Waking on queue events, and the rescan that covers for missed ones."""

import threading
import time

from asyncgrpo.jobqueue import JobState, QueueWatcher
from asyncgrpo.jobqueue.queue import SCHEMA_VERSION
from asyncgrpo.run import fileops

NEVER_S = 600.0  # a rescan interval no test reaches: only an event can wake the waiter


def test_new_pending_job_wakes_the_waiter_by_event(queue, run):
    with QueueWatcher(run.queue, {JobState.PENDING}, rescan_s=NEVER_S) as watcher:
        writer = threading.Thread(target=queue.put_job, args=("000001_000", {}), kwargs={"created_step": 1})
        writer.start()
        assert watcher.wait(timeout=30)
        writer.join()
        assert queue.claim(1).job_id == "000001_000"


def test_requeue_by_rename_wakes_the_waiter(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    queue.claim(1)
    with QueueWatcher(run.queue, {JobState.PENDING}, rescan_s=NEVER_S) as watcher:
        [action] = queue.recover()  # dev1 holds no lock: requeued by a rename inside queue/
        assert action.what == "requeue"
        assert watcher.wait(timeout=30)


def test_only_watched_states_wake(queue, run):
    with QueueWatcher(run.queue, {JobState.COMPLETE}, rescan_s=NEVER_S) as watcher:
        queue.put_job("000001_000", {}, created_step=1)
        job = queue.claim(1)
        assert not watcher.wait(timeout=0.2)  # pending and processing files are not its business
        queue.complete(job, {}, weights_version=0)
        assert watcher.wait(timeout=30)


def test_missed_events_do_not_lose_a_job(queue, run):
    with QueueWatcher(run.queue, {JobState.PENDING}, rescan_s=0.05) as watcher:
        queue.put_job("000001_000", {}, created_step=1)
        assert watcher.wait(timeout=30)
        assert queue.claim(1).job_id == "000001_000"
        watcher.stop_events()  # events off mid-run: what inotify overflow or NFS looks like
        queue.put_job("000001_001", {}, created_step=1)
        woken_by = []
        for _ in range(200):  # each wait returns after at most one rescan interval
            woken_by.append(watcher.wait())
            if (job := queue.claim(1)) is not None:
                break
        assert job.job_id == "000001_001"
        assert not any(woken_by)  # found by the rescan, not by an event


def test_poll_only_mode_finds_jobs(queue, run):
    """With events off (NFS), a collector loop (wait, then scan) finds a result written while it
    waits, by polling: every wait returns after the poll interval, none is woken by an event."""
    poll_s, deadline_s = 0.01, 20.0
    payload = {"schema": SCHEMA_VERSION, "kind": "result", "job_id": "000001_000", "attempt": 1,
               "worker_device": 1, "weights_version": 0, "claimed_at": 0.0, "completed_at": 0.0, "data": {}}
    with QueueWatcher(run.queue, {JobState.COMPLETE}, use_events=False, rescan_s=poll_s) as watcher:
        polled_empty, found, woken_by = threading.Event(), [], []

        def collector_loop():
            started = time.monotonic()
            while not found and time.monotonic() - started < deadline_s:
                woken_by.append(watcher.wait())
                found.extend(r.job_id for r in queue.collect())
                polled_empty.set()  # one round found nothing (the result is written after it)

        collector = threading.Thread(target=collector_loop, daemon=True)
        collector.start()
        assert polled_empty.wait(timeout=30), "a wait in poll-only mode never returned"
        fileops.write_payload(run.tmp, run.queue / "000001_000_complete_from_dev1.pt", payload)
        written = time.monotonic()
        collector.join(timeout=deadline_s + 10)
        if collector.is_alive():
            watcher.wake()  # let the thread go before failing
        assert not collector.is_alive(), "a wait in poll-only mode never returned"
        assert found == ["000001_000"], "polling never found the result"
        assert time.monotonic() - written < deadline_s
        assert len(woken_by) >= 2 and not any(woken_by), woken_by  # found by polling, not by an event


def test_wake_interrupts_a_wait_from_another_thread(run):
    with QueueWatcher(run.queue, {JobState.PENDING}, rescan_s=NEVER_S) as watcher:
        threading.Thread(target=watcher.wake).start()
        assert watcher.wait(timeout=30)
