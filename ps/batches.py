"""Where the trainer's batches come from: one interface on every rank of the PS.

The first rank is the queue client: its batches come from the job pipeline (ps/pipeline.py), and under
``--ps-procs`` it broadcasts each one (TRL's own vLLM-server pattern); every other rank receives the
broadcast. Either way the trainer (ps/trainer.py) calls ``take`` once per batch and ``step_trained`` after
each optimizer step, and reads ``in_training``: the batch whose steps are being trained, counted down alike
on every rank, so that every rank agrees on where a batch ends (checkpoints are saved only there).
A stop request (``--checkpoint_on_sigterm``) reaches every rank as StopRequested from ``take``.
"""

from __future__ import annotations

import time
from typing import Protocol

from accelerate.utils import broadcast_object_list

from asyncgrpo.events import EventLog
from ps.pipeline import BatchInTraining, JobPipeline, StopRequested, TrainingBatch


class BatchSource(Protocol):
    @property
    def in_training(self) -> BatchInTraining | None: ...

    def take(self, step: int) -> TrainingBatch:
        """The batch whose first step is ``step + 1`` (raises StopRequested)."""

    def step_trained(self, step: int) -> None:
        """Optimizer step ``step`` has trained (and its weights are published)."""


class PipelineBatches:
    """The first rank's: the pipeline's batches, broadcast to the other ranks when there are any."""

    def __init__(self, pipeline: JobPipeline, events: EventLog, broadcast: bool = False):
        self.pipeline, self.events, self.broadcast = pipeline, events, broadcast

    @property
    def in_training(self) -> BatchInTraining | None:
        return self.pipeline.in_training

    def take(self, step: int) -> TrainingBatch:
        started = time.monotonic()
        taken, stop = None, None
        try:
            taken = self.pipeline.next_batch(step)
        except StopRequested as request:
            stop = str(request)
        if taken is not None:
            self._emit_taken(taken, step + 1, started)
        if self.broadcast:  # the other ranks wait in their take while this one waits for a result
            broadcast_object_list([(taken, stop)], from_process=0)
        if stop is not None:
            raise StopRequested(stop)
        return taken

    def _emit_taken(self, taken: TrainingBatch, step: int, started: float) -> None:
        self.events.emit("wait_result", step=step, dur_ms=(time.monotonic() - started) * 1e3)
        for part in taken.in_training.parts:  # one event per result the batch takes groups from
            self.events.emit("result_consumed", job_id=part.job_id, weights_version=part.weights_version, step=step,
                             staleness=part.staleness(step), samples=part.samples, tokens=part.tokens,
                             groups=part.groups, of_groups=part.of_groups,
                             token_staleness={str(s): n for s, n in part.tokens_by_staleness(step).items()})

    def step_trained(self, step: int) -> None:
        self.pipeline.on_step_end(step)


class BroadcastBatches:
    """Every other rank's: the first rank's batches, received; its copy of the batch in training counted down
    as the pipeline counts its own."""

    def __init__(self):
        self.in_training: BatchInTraining | None = None

    def take(self, step: int) -> TrainingBatch:
        taken, stop = broadcast_object_list([None], from_process=0)[0]
        if stop is not None:
            raise StopRequested(stop)
        self.in_training = taken.in_training
        return taken

    def step_trained(self, step: int) -> None:
        if self.in_training is not None and self.in_training.trained_one_step():
            self.in_training = None
