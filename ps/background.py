"""A PS background thread that sleeps on a queue watcher between rounds (producer, collector).

Supervised: an exception in ``_loop`` is not swallowed by the thread; it is handed to
``on_error`` (the pipeline), which stops training with it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from asyncgrpo.jobqueue import QueueWatcher
from asyncgrpo.messages import join_or_report

log = logging.getLogger("asyncgrpo.ps")


class WatchedThread:
    """Runs ``self._loop`` on a daemon thread; ``stop()`` wakes it from the watcher and joins it."""

    def __init__(self, name: str, watcher: QueueWatcher, on_error: Callable[[str, BaseException], None]):
        self.name = name
        self.watcher = watcher
        self.on_error = on_error
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _loop(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # noqa: BLE001 - every failure must reach the trainer
            self.on_error(self.name, err)

    def start(self):
        self.thread.start()
        return self

    def wake(self) -> None:
        """Look again now instead of at the next event or rescan."""
        self.watcher.wake()

    def stop(self) -> None:
        """Wakes the thread and joins it, the first time only: the PS stops its pipeline twice on the way out
        (ps/trainer.py: train, close), and a thread that did not stop within the bound the first time is left to
        die with the process, not waited for again."""
        first = not self.stop_event.is_set()
        self.stop_event.set()
        self.watcher.wake()
        if first and self.thread.is_alive():
            join_or_report(self.thread, f"[queue] the {self.name}", log)
        self.watcher.close()
