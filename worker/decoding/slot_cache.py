"""The continuous engine's KV cache (worker/decoding/continuous.py): one ring of columns shared by every slot, and
where a step reads it.

Every step writes every slot's newest key and value at the same column, ``at``, then the next one round the ring; a
joining row's prompt goes into the prompt part of columns just before it. A row lives for at most prompt part +
max_completion_length columns (``size``), so it never overwrites its own. A slot attends to its own columns through
its row of a mask (a key's column does not matter to attention: RoPE placed it by the row's own position ids).

A step reads the ring's first columns only, up to the first of a few ``reads`` past the column it writes (a graph
each, as the graph decoder's column buckets, worker/decoding/attention.py), while every decoding row started in the
ring's current lap; once one started in the lap before, the whole ring. When no row is decoding, the next rows start
at the front again. So rows that start and end together (fixed lengths: every job's at once) read what the graph
decoder's would, and a long tail, where some row is nearly always a lap old, reads the whole ring. (Moving the rows'
columns down to the front, to read less, costs more copying than it saves there.)
"""

from __future__ import annotations

import bisect

import torch

from worker.decoding.attention import ATTENTION_BUCKETS, column_buckets
from worker.decoding.graph import static_buffer


class SlotCache:
    """Keys and values [slots, heads, columns, dim] per layer; every step writes every slot at ``column``. What
    transformers' attention layers ask of a cache here is ``update``."""

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], column: torch.Tensor):
        self.keys, self.values, self.column = keys, values, column

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.column, key_states)
        self.values[layer_idx].index_copy_(2, self.column, value_states)
        return self.keys[layer_idx], self.values[layer_idx]


class SlotColumns:
    """Where the steps write and read, on the host (the device's copy of ``at`` is ``column``, which the steps
    advance), and the column each decoding row started at, counted over the ring's laps."""

    def __init__(self, prompt_part: int, max_new: int, device: torch.device):
        self.prompt_part = prompt_part
        self.size = prompt_part + max_new
        self.reads = column_buckets(prompt_part, max_new, ATTENTION_BUCKETS)  # the graph decoder's
        self.column = static_buffer(1, device=device)
        self.lap = 0  # where the ring's current lap starts, counted over laps
        self.first: dict[int, int] = {}  # slot: the first column of its row's prompt, counted over laps
        self.go_to(prompt_part)

    def go_to(self, column: int) -> None:
        """The next step writes ``column`` (no row is decoding)."""
        self.at = column
        self.column.fill_(column)

    def joining(self) -> None:
        """Rows are about to join: with none decoding, they start at the front."""
        if not self.first and self.at != self.prompt_part:
            self.go_to(self.prompt_part)

    def joined(self, slots: list[int], width: int) -> None:
        """Rows joined ``slots``: their prompts are in the ``width`` columns just before ``at``."""
        for slot in slots:
            self.first[slot] = self.lap + self.at - width

    def left(self, slots: list[int]) -> None:
        for slot in slots:
            self.first.pop(slot, None)

    def read(self) -> int:
        """The columns the next step reads: a bucket past the one it writes, or the whole ring while a row that
        started in the lap before decodes."""
        if min(self.first.values(), default=self.lap) < self.lap:
            return self.size
        return self.reads[bisect.bisect_right(self.reads, self.at)]

    def stepped(self) -> None:
        self.at += 1
        if self.at == self.size:
            self.at, self.lap = 0, self.lap + self.size
