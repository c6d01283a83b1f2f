"""Continuous batching in the worker's loop (worker/generation.py EngineGeneration): its scoring thread (Scorer) names
what it holds in the heartbeat, keeps working when a job is handed over again (its next attempt, the same job id)
while it still ends the first attempt, and says what each job came to; a joining job is sampled by the newest
weights."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from worker.generation import EngineGeneration, Scorer, _Held

WAIT_S = 30


class RecordingScorer(Scorer):
    """A Scorer whose publishing only records, and waits for ``release`` on the first job it is handed."""

    def __init__(self):
        self.seen, self.release, self.started = [], threading.Event(), threading.Event()
        super().__init__(cfg=None, queue=None, trainer=None, engine=None, events=None)

    def _publish(self, entry, finished):
        if not self.seen:
            self.started.set()
            assert self.release.wait(WAIT_S)
        self.seen.append((entry.job.job_id, entry.job.attempt))
        return entry.job.attempt == 2  # what publish says: written, or not (failed, given back)


def held(job_id: str, attempt: int) -> _Held:
    return _Held(SimpleNamespace(job_id=job_id, attempt=attempt), prompt_ids=[], claimed=0.0)


def test_a_jobs_next_attempt_handed_over_while_its_first_is_ended_keeps_the_thread_working():
    scorer = RecordingScorer()
    try:
        scorer.submit(held("000000_003", 1), finished=None)  # it fails: thrown again as attempt 2 ...
        assert scorer.started.wait(WAIT_S)
        scorer.submit(held("000000_003", 2), finished=None)  # ... claimed and decoded again meanwhile
        assert sorted(scorer.in_hand()) == ["000000_003", "000000_003"]
        scorer.release.set()
        scorer.submit(held("000001_000", 1), finished=None)
    finally:
        scorer.close(WAIT_S)
    scorer.check()
    assert scorer.seen == [("000000_003", 1), ("000000_003", 2), ("000001_000", 1)]
    assert scorer.in_hand() == []
    assert scorer.published() == [False, True, False] and scorer.published() == []  # (the back-off)


def test_a_job_whose_publishing_raises_stays_named_and_the_error_reaches_the_main_thread():
    class Failing(RecordingScorer):
        def _publish(self, entry, finished):
            raise OSError("disk gone")

    scorer = Failing()
    scorer.submit(held("000002_000", 1), finished=None)
    scorer.close(WAIT_S)
    assert scorer.in_hand() == ["000002_000"]  # still held: it returns through recovery
    try:
        scorer.check()
    except OSError as err:
        assert str(err) == "disk gone"
    else:
        raise AssertionError("the scoring thread's error did not reach the main thread")


def test_a_joining_job_is_sampled_by_the_newest_weights(tmp_path):
    """The engine syncs before a job joins the slots, as a batch syncs before it starts: a version published since
    the engine's last look samples the joining job's first token (the job's oldest version is the newest one)."""
    import torch
    from helpers.decoding import GREEDY, job_ids, llama, trainer_for

    from asyncgrpo.events import EventLog
    from worker.decoding.continuous import ContinuousDecoding

    class Subscriber:  # a PS published version 8 since the engine's last look
        synced_bytes = 0

        def __init__(self):
            self.pending = [8]

        def sync(self, model):
            return self.pending.pop() if self.pending else None

    trainer = trainer_for(tmp_path, llama(), **GREEDY)
    engine = ContinuousDecoding(trainer, trainer.args.generation_batch_size, job_ids(trainer, 0), compile=False)
    generation = EngineGeneration(trainer.args, None, trainer, engine, Subscriber(), EventLog.off(),
                                  SimpleNamespace(device=1), threading.Event(), None)
    generation.version = 7
    entry = _Held(SimpleNamespace(job_id="000008_000", attempt=1), prompt_ids=job_ids(trainer, 0), claimed=0.0)
    with torch.no_grad():
        generation._join(entry)
    [resident] = engine.scheduler.residents
    assert generation.version == 8 and resident.runs == [[(0, 8)]] * engine.rows_per_job
