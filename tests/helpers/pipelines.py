"""The PS's job pipeline (ps/pipeline.py) for in-process tests over a real run directory, and a background thread
that is stuck: a job is 2 prompts x 2 generations, drawn from 40 prompts.

Imported as ``helpers.pipelines`` (not re-exported by ``helpers``: it imports torch through ``ps``).
"""

from __future__ import annotations

import threading

from asyncgrpo.config_parser import parse_config
from asyncgrpo.jobqueue import JobQueue
from ps.background import WatchedThread
from ps.pipeline import JobPipeline

GENERATIONS = 2
ROWS = 4  # generation_batch_size: 2 prompts x 2 generations, a job and a batch
DATASET = [{"prompt": f"p{i}"} for i in range(40)]


def pipeline_config(**overrides):
    flags = {"generation_batch_size": ROWS, "per_device_train_batch_size": ROWS, "num_generations": GENERATIONS,
             "max_pending": 8, "max_outstanding": 16, "max_staleness": 4, "lease_s": 30, "seed": 0,
             "model_name_or_path": "unused", "output_dir": "unused", **overrides}
    return parse_config([f"--{k}={v}" for k, v in flags.items()])


def make_pipeline(run, **overrides) -> JobPipeline:
    return JobPipeline(pipeline_config(**overrides), run, JobQueue(run), DATASET)


class Stuck(WatchedThread):
    """A loop that does not look at its stop event: stuck in something that never returns."""

    def __init__(self, watcher, release: threading.Event):
        super().__init__("stuck loop", watcher, on_error=lambda name, err: None)
        self.release = release

    def _loop(self) -> None:
        self.release.wait()
