"""Waking on queue events: watchdog (inotify) with a periodic rescan as a safety net.

inotify drops events when its queue overflows and sees nothing on NFS, so a waiter
never trusts events alone: ``wait`` returns at the latest after ``rescan_s`` and the
caller scans the directory again. With ``use_events=False`` (NFS and other filesystems
without events) it is a plain poll every ``rescan_s``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from watchdog.events import FileCreatedEvent, FileMovedEvent, FileSystemEventHandler
from watchdog.observers import Observer

from asyncgrpo.jobqueue.names import JobState, parse_queue_name

RESCAN_S = 1.0  # safety-net rescan with events on; a missed event costs at most this
POLL_S = 0.05  # poll interval with events off (the original system's loop)


class QueueWatcher(FileSystemEventHandler):
    """``wait()`` returns when a file of one of ``states`` appears in ``queue_dir``."""

    def __init__(self, queue_dir: str | os.PathLike, states: Iterable[JobState], *,
                 use_events: bool = True, rescan_s: float | None = None):
        self.states = frozenset(states)
        self.use_events = use_events
        self.rescan_s = rescan_s if rescan_s is not None else (RESCAN_S if use_events else POLL_S)
        self._wake = threading.Event()
        self._observer = None
        if use_events:
            self._observer = Observer()
            self._observer.schedule(self, os.fspath(queue_dir), recursive=False,
                                    event_filter=[FileCreatedEvent, FileMovedEvent])
            self._observer.start()

    def _notice(self, path: str | bytes) -> None:
        name = parse_queue_name(os.path.basename(os.fsdecode(path)))
        if name is not None and name.state in self.states:
            self._wake.set()

    def on_created(self, event) -> None:
        self._notice(event.src_path)

    def on_moved(self, event) -> None:
        self._notice(event.dest_path)

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
        if self._observer is not None:
            self._observer.stop()
            self._observer.join()
            self._observer = None

    def close(self) -> None:
        self.stop_events()

    def __enter__(self) -> QueueWatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
