"""A PS background thread that sleeps on a queue watcher between rounds (producer, collector)."""

from __future__ import annotations

import threading

from asyncgrpo.jobqueue import QueueWatcher


class WatchedThread:
    """Runs ``self._run`` on a daemon thread; ``stop()`` wakes it from the watcher and joins it."""

    def __init__(self, name: str, watcher: QueueWatcher):
        self.watcher = watcher
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self):
        self.thread.start()
        return self

    def wake(self) -> None:
        """Look again now instead of at the next event or rescan."""
        self.watcher.wake()

    def stop(self) -> None:
        self.stop_event.set()
        self.watcher.wake()
        self.thread.join()
        self.watcher.close()
