"""The exactly-once ledger: which results are trained into the weights, kept per group.

Part of the job pipeline (ps/pipeline.py), which asks it; saved in each checkpoint (JobPipeline.state_dict, with
the producer's journal) and read back on resume, where a result archived ``consumed`` but missing from the
ledger goes back to the queue (JobQueue.roll_back_consumed) to be trained again.

A result is consumed when every one of its groups is trained or dropped; the groups done of results partly used
are kept apart (``groups_done``). The groups of a batch enter the ledger when the batch's last step has trained;
the trainer saves checkpoints only between batches, so a checkpoint's ledger never holds a batch half trained
(except the final one, where a batch cut short by ``max_steps``, and a result whose groups wait for a next batch,
count as consumed: no later step will train the rest). A result is archived ``consumed`` when its last groups are
taken (while some wait for the next batch it stays in queue/ as collected, and a restart re-adopts it and takes the
groups not done); ``filtered`` when every group was dropped, with a ``filtered`` record in done/ for the groups
dropped from a result otherwise trained.

The checkpoint's format: ``{"consumed": [job ids, sorted], "groups_done": {job id: [groups, sorted]}}``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class GroupsTaken:
    """One result's groups in a training batch: what the ledger records when the batch has trained."""

    job_id: str
    weights_version: int
    groups: list[int]
    of_groups: int  # how many the result holds
    samples: int  # rows (completions) taken
    tokens: int  # completion tokens taken
    tokens_by_version: dict[int, int] | None = None  # of those tokens, how many each weights version sampled

    def staleness(self, step: int) -> int:
        """Its staleness in optimizer step ``step``: the weights that step starts from (``step - 1``) less the
        result's (the behaviour's). The one place it is computed: the metrics line, the events and ``ls`` read it."""
        return step - 1 - self.weights_version

    def tokens_by_staleness(self, step: int) -> dict[int, int]:
        """Its completion tokens by their own staleness in step ``step`` (with in-flight updates a result's later
        tokens were sampled by newer weights than its weights_version)."""
        by_version = self.tokens_by_version or {self.weights_version: self.tokens}
        return {step - 1 - version: tokens for version, tokens in sorted(by_version.items())}


class Ledger:
    def __init__(self):
        self.consumed: set[str] = set()  # results whose every group is trained into the weights (or dropped)
        self._groups_done: dict[str, set[int]] = {}  # of results partly trained

    def is_consumed(self, job_id: str) -> bool:
        return job_id in self.consumed

    def is_partly_done(self, job_id: str) -> bool:
        """Some groups of ``job_id`` are done (trained or dropped), not all."""
        return job_id in self._groups_done

    def groups_done_of(self, job_id: str) -> set[int]:
        return set(self._groups_done.get(job_id, ()))

    def trained(self, parts: Iterable[GroupsTaken]) -> None:
        """The last step of the batch of ``parts`` has trained: their groups are done, and each result whose every
        group is done is consumed."""
        for part in parts:
            done = self._groups_done.setdefault(part.job_id, set())
            done.update(part.groups)
            if len(done) == part.of_groups:
                self.consumed.add(part.job_id)
                del self._groups_done[part.job_id]

    def drop(self, job_id: str, groups: Iterable[int]) -> None:
        """``groups`` of ``job_id`` are dropped (dynamic sampling): done, without training."""
        self._groups_done.setdefault(job_id, set()).update(groups)

    def close(self, job_id: str, consumed: bool) -> None:
        """Every group of ``job_id`` left was dropped: it is no longer partly done, and ``consumed`` when it was
        archived so (groups of it done before a restart may have trained)."""
        self._groups_done.pop(job_id, None)
        if consumed:
            self.consumed.add(job_id)

    def state_dict(self, cut_short: Iterable[str] = ()) -> dict:
        """The ledger as a checkpoint holds it. ``cut_short``: results no later step will train the rest of (the
        final checkpoint's batch cut short by max_steps, a leftover result): counted as consumed."""
        cut_short = set(cut_short)
        consumed = self.consumed | cut_short
        groups_done = {job: done for job, done in self._groups_done.items() if job not in cut_short}
        return {"consumed": sorted(consumed), "groups_done": {job: sorted(done) for job, done in groups_done.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = set(state.get("consumed", []))
        self._groups_done = {job: set(done) for job, done in state.get("groups_done", {}).items()}
