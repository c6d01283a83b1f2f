"""A job in the continuous engine (worker/decoding/continuous.py): its rows, the slots they decode in, the versions
that sampled their tokens, its groups of rows of one prompt; and what the engine hands out once its rows have all
ended."""

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
    first_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # by group: its prefill's last logits

    def __post_init__(self):
        rows = len(self.prompt_ids)
        self.slots, self.joined, self.runs = [None] * rows, [None] * rows, [[] for _ in range(rows)]
        firsts: dict[tuple[int, ...], int] = {}
        self.group = [firsts.setdefault(tuple(ids), row) for row, ids in enumerate(self.prompt_ids)]

    def seated_sibling(self, row: int) -> int | None:
        """The slot of a row of ``row``'s group that holds its prompt's keys and values (it is in a slot, its
        group's first logits kept), or None."""
        if self.group[row] not in self.first_logits:
            return None
        return next((slot for r, slot in enumerate(self.slots)
                     if slot is not None and self.group[r] == self.group[row]), None)
