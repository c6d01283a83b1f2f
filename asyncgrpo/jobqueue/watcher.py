"""Waking on queue events: inotify through watchdog, with a periodic rescan as a safety net.

inotify drops events when its queue overflows and sees nothing on NFS, so a waiter
never trusts events alone: ``wait`` returns at the latest after ``rescan_s`` and the
caller scans the directory again. With ``use_events=False`` (``--poll_only``) it is a plain
poll every ``rescan_s``; so it is, with one log line, on a filesystem where other hosts'
changes raise no event here (NFS, CIFS, cluster and FUSE filesystems: hosts.py).

Why watchdog's ``InotifyFD`` and not its ``Observer``: the Observer asks inotify for
IN_MOVED_FROM too (to pair moves), holds each one up to 0.5 s waiting for its partner,
and delivers in order, so one pair split across two reads stalls every later event
(measured: 0.45 s stalls under CPU load). It also passes each event through three
threads. A file arriving in ``queue/`` is all a waiter needs to know, which is
IN_CREATE (our writes link into place) or IN_MOVED_TO (claims, fences, collects,
requeues): with only those in the mask there is nothing to pair, and ``InotifyFD``
calls us straight from its one reader thread. Tested against watchdog 7.x
(tests/asyncgrpo/jobqueue/test_watcher.py); pyproject pins that range.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

from watchdog.observers.inotify_c import InotifyConstants, InotifyEvent, InotifyFD

from asyncgrpo.jobqueue.names import JobState, parse_queue_name
from asyncgrpo.messages import join_or_report, log_once
from asyncgrpo.run.hosts import network_filesystem

log = logging.getLogger("asyncgrpo.queue")

RESCAN_S = 1.0  # safety-net rescan with events on; a missed event costs at most this
POLL_S = 0.05  # poll interval with events off
_MASK = InotifyConstants.IN_CREATE | InotifyConstants.IN_MOVED_TO | InotifyConstants.IN_ONLYDIR


class QueueWatcher:
    """``wait()`` returns when a file of one of ``states`` appears in ``queue_dir``."""

    def __init__(self, queue_dir: str | os.PathLike, states: Iterable[JobState], *,
                 use_events: bool = True, rescan_s: float | None = None):
        self.states = frozenset(states)
        if use_events and (kind := network_filesystem(queue_dir)):
            use_events = False
            log_once(log, "[queue] %s is on %s, where inotify cannot see other hosts' changes: polling every "
                     "%.0f ms (as with --poll_only)", queue_dir, kind, POLL_S * 1e3)
        self.use_events = use_events
        self.rescan_s = rescan_s if rescan_s is not None else (RESCAN_S if use_events else POLL_S)
        self._wake = threading.Event()
        self._inotify: InotifyFD | None = None
        if use_events:
            self._inotify = InotifyFD()  # our own inotify instance and reader thread
            self._inotify.add_callback(os.fsencode(queue_dir), _MASK, self, id_="queue-watcher")
            self._inotify.start()

    # watchdog's WatchCallback protocol; called on the InotifyFD reader thread.
    def on_event(self, event: InotifyEvent) -> None:
        name = parse_queue_name(os.fsdecode(event.name))
        if name is not None and name.state in self.states:
            self._wake.set()

    def on_queue_overflow(self) -> None:
        self._wake.set()  # events were lost: rescan now

    def on_watch_deleted(self, wd) -> None:
        if self._inotify is not None and not self._inotify.stopped_event.is_set():
            self._wake.set()  # queue/ itself went away: let the caller find out by scanning

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until an event, the rescan interval or ``timeout``; True if an event woke it."""
        limit = self.rescan_s if timeout is None else min(timeout, self.rescan_s)
        woke = self._wake.wait(limit)
        self._wake.clear()
        return woke

    def wake(self) -> None:
        """Lets another thread of this process interrupt ``wait`` (shutdown, new work)."""
        self._wake.set()

    def stop_events(self) -> None:
        """Turns file events off; only the rescan remains (what NFS looks like)."""
        if self._inotify is not None:
            self._inotify.stop()
            join_or_report(self._inotify, "[queue] the queue watcher's inotify reader", log)
            self._inotify = None

    def close(self) -> None:
        self.stop_events()

    def __enter__(self) -> QueueWatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
