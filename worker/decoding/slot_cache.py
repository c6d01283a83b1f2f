"""The continuous engine's KV cache and per-slot state (worker/decoding/continuous.py), and which of the cache's
columns each step reads.

Each slot has its own columns, as a fixed batch's row has: a row's prompt ends just before the prompt part's end
(``prompt_part``) and its i-th completion token's key and value go into column ``prompt_part + i``, whenever the
row joined. So a row reads a prefix of its slot's columns, as long as the row is old.

Long-tail lengths keep rows of every age in the slots at once: a step that read every slot's columns up to the
oldest row's would read nearly the whole cache. Instead, ranges of slots read their own number of columns
(``SlotReads.tiered``: half the slots the graph decoder's first column bucket, a quarter the second, and so on, the
last range the whole cache), and a row about to outgrow its range's columns moves to a slot of a range that reads
more: a free one, or one whose row is young enough to take its place (the two swap). Where that cannot be done
(rows that start and end together, fixed lengths: every row is as old), or where it would read more, every slot
reads the same prefix, a bucket past the oldest row's (``SlotReads.uniform``: what the graph decoder's step
reads). Either way each plan is a graph, compiled once in the warm-up.
"""

from __future__ import annotations

import functools

import torch

from worker.decoding.attention import ATTENTION_BUCKETS, column_buckets
from worker.decoding.graph import static_buffer

# A plan of reads: (slots, columns) for consecutive ranges of slots, from the first; or columns for every slot.
Plan = tuple[tuple[int, int], ...] | int


class SlotCache:
    """Keys and values [slots, heads, columns, dim] per layer; a step writes each slot's at its own ``column``. What
    transformers' attention layers ask of a cache here is ``update``."""

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], column: torch.Tensor):
        self.keys, self.values, self.column = keys, values, column
        self.slots = static_buffer(column.size(0), device=column.device)
        self.slots.copy_(torch.arange(column.size(0), device=column.device))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        where = (self.slots, self.column)
        self.keys[layer_idx].transpose(1, 2).index_put_(where, key_states[:, :, 0])
        self.values[layer_idx].transpose(1, 2).index_put_(where, value_states[:, :, 0])
        return self.keys[layer_idx], self.values[layer_idx]


class SlotReads:
    """The plans a step may read by (``plans``, a graph each), and the one for the next steps, with the moves of rows
    between slots it needs."""

    def __init__(self, slots: int, prompt_part: int, max_new: int):
        self.slots, self.prompt_part = slots, prompt_part
        self.size = prompt_part + max_new
        self.uniform = column_buckets(prompt_part, max_new, ATTENTION_BUCKETS)  # the graph decoder's
        counts = [slots >> (i + 1) for i in range(len(self.uniform) - 1)]
        counts.append(slots - sum(counts))
        self.tiered = tuple((n, columns) for n, columns in zip(counts, self.uniform, strict=True) if n)
        if len(self.tiered) < 2 or self.tiered[-1][1] != self.size:
            self.tiered = None  # (too few slots or buckets to range)
        self.columns_of_slot = [columns for n, columns in self.tiered or () for _ in range(n)]
        # A moving row's destinations, the slots of fewest columns first.
        self.by_columns = sorted(range(slots), key=lambda s: (self.columns_of_slot[s], s)) if self.tiered else []

    @property
    def plans(self) -> list:
        return self.uniform + ([self.tiered] if self.tiered else [])

    def plan(self, reach: dict[int, int]) -> tuple[Plan, list[tuple[int, int]]]:
        """The plan for the next steps, given the columns each occupied slot's row reads by their end ({slot:
        columns}), and the moves (from slot, to slot) to make first: the tiered plan where rows can be moved so that
        each range's rows fit its columns and it reads fewer columns than the uniform one, else the uniform one."""
        widest = max(reach.values(), default=self.prompt_part)
        uniform = next(columns for columns in self.uniform if columns >= widest)
        if self.tiered is None or self.slots * uniform <= sum(self.columns_of_slot):
            return uniform, []
        moves = self._arranged(reach)
        return (uniform, []) if moves is None else (self.tiered, moves)

    def _arranged(self, reach: dict[int, int]) -> list[tuple[int, int]] | None:
        """Moves that leave every row in a slot whose range reads as many columns as the row will, or None. The rows
        that outgrow their slot, the oldest first, each take the slot of fewest columns that holds it and is free
        (first) or holds a row that fits the moving row's slot (the two swap)."""
        columns = self.columns_of_slot
        outgrown = sorted((s for s, r in reach.items() if r > columns[s]), key=lambda s: -reach[s])
        moves, settled = [], set(outgrown)  # settled: slots no other row may take
        for slot in outgrown:
            holding = [d for d in self.by_columns if columns[d] >= reach[slot] and d not in settled]
            free = next((d for d in holding if d not in reach), None)
            swap = next((d for d in holding if d in reach and reach[d] <= columns[slot]), None)
            to = min((d for d in (free, swap) if d is not None), key=columns.__getitem__, default=None)
            if to is None:
                return None
            moves.append((slot, to))
            if to in reach:
                moves.append((to, slot))
            settled.add(to)
        return moves


class SlotState:
    """The engine's device buffers, allocated once (CUDA graphs read and write them in place)."""

    def __init__(self, slots: int, prompt_part: int, max_new: int, device: torch.device):
        buffer = functools.partial(static_buffer, device=device)

        self.mask = buffer(slots, prompt_part + max_new, dtype=torch.bool)  # the columns each slot attends to
        self.column = buffer(slots)  # the column the next step writes, each slot its own
        self.last = buffer(slots)  # the token each slot feeds to the next step
        self.position = buffer(slots)  # its position (RoPE)
        # Tokens the slot's row has sampled (its next token's index); while its prompt is fed through the steps,
        # minus the prompt's tokens still to feed after ``last``.
        self.count = buffer(slots)
        self.prompt = buffer(slots, prompt_part)  # a fed prompt, ending at the prompt part's end
        self.ended = buffer(slots, dtype=torch.bool)
        self.active = buffer(slots, dtype=torch.bool)  # holds a row of a job in the engine
        self.seed = buffer(slots)
        self.tokens = buffer(slots, max_new + 1)  # the last column takes the writes of rows that ended
        self.logps = buffer(slots, max_new + 1, dtype=torch.float32)
        self.seen: torch.Tensor | None = None  # with a repetition penalty: [slots, vocab + 1]
