"""A job in the continuous engine (worker/decoding/continuous.py): its rows, the slots they decode in, the versions
that sampled their tokens, its groups of rows of one prompt; and what the engine hands out once its rows have all
ended; and the scheduler's word to the runner of how rows join their slots (``Joining``). The scheduler
(worker/decoding/scheduler.py) writes where a job's rows are; the runner (worker/decoding/slot_runner.py) keeps its
groups' first logits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from asyncgrpo.jobqueue.handoff import oldest_version


@dataclass
class FinishedJob:
    """A job whose rows have all ended: TRL's ``_generate_single_turn`` output for its prompts (completion ids cut
    after the first EOS), the tokens and behaviour log-probs [rows, tokens] on the CPU, and each row's runs of the
    versions that sampled them."""

    key: object
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    tokens: torch.Tensor
    logps: torch.Tensor
    token_versions: list[list[tuple[int, int]]]
    decode_s: float  # from its ``add`` to its last row's end
    steps: int  # the engine's decoding steps over the same span

    @property
    def weights_version(self) -> int:
        return oldest_version(self.token_versions)


@dataclass
class Sequence:
    """A job in the engine. Row i decodes in slot ``slots[i]`` (None while it waits for one, and once it ended)
    from engine step ``joined[i]``, sampled by the versions of ``runs[i]``; the rows that ended are copied out:
    {row: (tokens, log-probs)}."""

    key: object
    prompt_ids: list[list[int]]
    seeds: list[int]
    slots: list[int | None] = field(init=False)
    joined: list[int | None] = field(init=False)
    runs: list[list[tuple[int, int]]] = field(init=False)
    ended: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    added_at: float = field(default_factory=time.monotonic)
    added_step: int = 0
    # Rows of one prompt (TRL's G generations of it) are a group: row i's is ``group[i]``, its first row's index.
    group: list[int] = field(init=False)
    # The groups whose prompt a row was prefilled for, to be copied by the others: the scheduler adds a group when
    # it plans the prefill, the runner keeps its last logits then (the others' first tokens are sampled from them).
    prefilled: set[int] = field(default_factory=set)
    first_logits: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        rows = len(self.prompt_ids)
        self.slots, self.joined, self.runs = [None] * rows, [None] * rows, [[] for _ in range(rows)]
        firsts: dict[tuple[int, ...], int] = {}
        self.group = [firsts.setdefault(tuple(ids), row) for row, ids in enumerate(self.prompt_ids)]

    def seated_sibling(self, row: int) -> int | None:
        """The slot of a row of ``row``'s group that holds its prompt's keys and values (it is in a slot, its
        group's prompt prefilled for copies), or None."""
        if self.group[row] not in self.prefilled:
            return None
        return next((slot for r, slot in enumerate(self.slots)
                     if slot is not None and self.group[r] == self.group[row]), None)

    def finished(self, pad: int, steps: int) -> FinishedJob:
        """What the engine hands out once every row has ended (``steps``: the engine's steps so far)."""
        rows = [self.ended[row] for row in range(len(self.slots))]
        width = max(len(t) for t, _ in rows)
        tokens = torch.full((len(rows), width), pad, dtype=torch.long)
        logps = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (t, lp) in enumerate(rows):
            tokens[i, :len(t)], logps[i, :len(lp)] = t, lp
        runs = [[(first, version) for first, version in self.runs[row] if first < max(len(t), 1)]
                for row, (t, _) in enumerate(rows)]
        return FinishedJob(self.key, self.prompt_ids, [t.tolist() for t, _ in rows], tokens, logps, runs,
                           time.monotonic() - self.added_at, steps - self.added_step)


@dataclass
class Joining:
    """Rows (job, row) that join ``slots`` in one go, ``how``: "fed", "prefilled" (in one prefill of ``size`` rows,
    the last row repeated to fill it) or "copied" (each from the slot of its group in ``origins``)."""

    how: str
    rows: list[tuple[Sequence, int]]
    slots: list[int]
    size: int = 0
    origins: list[int] = field(default_factory=list)
