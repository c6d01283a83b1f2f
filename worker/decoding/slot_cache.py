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

When few slots hold rows (the stream's end, a queue that runs dry), a step computes only the first slots
(``SlotReads.widths``: a half, a quarter, an eighth, a sixteenth of them, each reading the whole cache; one graph,
its number of rows a variable), the rows in the others moving into free slots among the first: on a CPU a step
costs about in proportion to its rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from worker.decoding.shapes import ATTENTION_BUCKETS, column_buckets, static_buffer

# A plan of reads: (slots, columns) for consecutive ranges of slots, from the first; or columns for every slot.
Plan = tuple[tuple[int, int], ...] | int


class StepPlan(NamedTuple):
    """The next steps: over the first ``width`` slots, reading the columns ``reads`` says, after the ``moves`` of rows
    (from slot, to slot)."""

    width: int
    reads: Plan
    moves: list[tuple[int, int]]

    @property
    def vacated(self) -> list[int]:
        """The slots the moves leave free."""
        return sorted({origin for origin, _ in self.moves} - {to for _, to in self.moves})

# Columns of the cache and the mask past any step's reads: a view of their first columns is then never the whole
# buffer, a contiguous tensor, which a graph whose number of columns is a variable would specialise on.
SPARE_COLUMNS = 1

# The fewest rows a narrower step computes (below it, a step costs about as much whatever its rows).
NARROWEST_STEP = 8


class SlotCache:
    """Keys and values [slots, heads, columns, dim] per layer; a step writes each slot's at its own ``column``. What
    transformers' attention layers ask of a cache here is ``update``."""

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], column: torch.Tensor):
        self.keys, self.values, self.column = keys, values, column
        self.slots = static_buffer(column.size(0), device=column.device)
        self.slots.copy_(torch.arange(column.size(0), device=column.device))

    def narrowed(self, column: torch.Tensor) -> SlotCache:
        """This cache's first slots, as many as ``column`` (the narrowed state's) has (``first_rows``)."""
        width = column.size(0)
        narrow = SlotCache([first_rows(k, width) for k in self.keys], [first_rows(v, width) for v in self.values],
                           column)
        torch._dynamo.mark_dynamic(narrow.slots, 0)
        return narrow

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        where = (self.slots, self.column)
        self.keys[layer_idx].transpose(1, 2).index_put_(where, key_states[:, :, 0])
        self.values[layer_idx].transpose(1, 2).index_put_(where, value_states[:, :, 0])
        return self.keys[layer_idx], self.values[layer_idx]


class SlotReads:
    """The steps a worker may run (``steps``: rows computed and the plan they read by, a graph each, the narrower
    ones one together), and the one for the next steps, with the moves of rows between slots it needs.
    ``narrower``: up to how many times a step may halve its rows."""

    def __init__(self, slots: int, prompt_part: int, max_new: int, narrower: int = 0):
        self.slots, self.prompt_part = slots, prompt_part
        self.size = prompt_part + max_new
        self.widths = [slots >> k for k in range(1, narrower + 1) if slots >> k >= NARROWEST_STEP]
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
    def steps(self) -> list[tuple[int, Plan]]:
        return [(self.slots, plan) for plan in self.uniform + ([self.tiered] if self.tiered else [])] + \
            [(width, self.size) for width in self.widths]

    def plan(self, reach: dict[int, int]) -> StepPlan:
        """The rows the next steps compute (the first slots'), the plan they read by, and the moves (from slot, to
        slot) to make first, given the columns each occupied slot's row reads by their end ({slot: columns}): the
        fewest of ``widths`` that hold the rows, which move into its free slots; else every slot, by the tiered plan
        where rows can be moved so that each range's rows fit its columns and it reads fewer columns than the uniform
        one, else by the uniform one."""
        width = min((w for w in self.widths if w >= len(reach)), default=self.slots)
        if width < self.slots:
            outside = sorted(slot for slot in reach if slot >= width)
            free = [slot for slot in range(width) if slot not in reach]
            return StepPlan(width, self.size, list(zip(outside, free[:len(outside)], strict=True)))
        widest = max(reach.values(), default=self.prompt_part)
        uniform = next(columns for columns in self.uniform if columns >= widest)
        if self.tiered is None or self.slots * uniform <= sum(self.columns_of_slot):
            return StepPlan(self.slots, uniform, [])
        moves = self._arranged(reach)
        return StepPlan(self.slots, uniform, []) if moves is None else StepPlan(self.slots, self.tiered, moves)

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

    def __init__(self, slots: int, prompt_part: int, max_new: int, device: torch.device, seen_vocab: int | None):
        buffer = functools.partial(static_buffer, device=device)

        # The columns each slot attends to (SPARE_COLUMNS more than any step reads).
        self.mask = buffer(slots, prompt_part + max_new + SPARE_COLUMNS, dtype=torch.bool)
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
        # The tokens each slot's row has seen, where a repetition penalty needs them: [slots, vocab + 1].
        self.seen = None if seen_vocab is None else buffer(slots, seen_vocab + 1, dtype=torch.bool)

    def narrowed(self, width: int) -> SlotState:
        """The first ``width`` slots' state (``first_rows``)."""
        narrow = object.__new__(SlotState)
        narrow.__dict__.update({name: None if t is None else first_rows(t, width) for name, t in vars(self).items()})
        return narrow


def first_columns(t: torch.Tensor, columns: int) -> torch.Tensor:
    """``t``'s first columns (dimension 1), a view whose numbers of rows and columns are variables of the graph that
    reads it (one graph for every number of columns: the steps whose slots all read the same columns)."""
    view = t[:, :columns]
    torch._dynamo.mark_static_address(view)
    torch._dynamo.mark_dynamic(view, 0)
    torch._dynamo.mark_dynamic(view, 1)
    return view


def first_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t``'s first rows, a view a narrower step reads and writes in place: its address static as ``t``'s, its
    number of rows a variable of the one graph that every narrower step runs."""
    view = t[:rows]
    torch._dynamo.mark_static_address(view)
    torch._dynamo.mark_dynamic(view, 0)
    return view
