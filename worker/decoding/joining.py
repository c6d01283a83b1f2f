"""How rows join the continuous engine's free slots (worker/decoding/continuous.py, whose part this is): prefilled, a
copy of a prefill of their prompt, or, with the prefill eager, a short prompt fed through the slot's next steps; and
how slots are freed and rows moved between them.

- A prefill runs the joining rows (prompts padded on the left, as TRL pads them) over a cache of their own, then
  writes their keys and values into their slots' prompt columns (the prompt ends at the prompt part's end) and
  chooses their first tokens. Eager (the CPU default), it takes the rows that join at once as they are, their
  prompts padded to the longest (a new cache each call; one call, not several: on the CPU machine a call costs 4-6 ms
  whatever its rows, most of it transformers' Python). Compiled (the CUDA default), each shape is a graph to compile
  (tens of seconds at 0.5B's shape), so there are two, PREFILL_FEW_ROWS and a job's rows by the prompt part, the
  joining rows padded up to the smaller that holds them by repeating the last (the same inputs, written to the same
  slot: the same values).
- A job's rows of one prompt (a group: TRL's G generations of it) share one prefill: the first of them to join is
  prefilled, and the others copy its slot's prompt columns (keys, values, mask) into theirs, their first tokens
  sampled from its prefill's last logits (kept while the job is in the engine) with their own draws. A row whose
  group has no row left in a slot is prefilled again.
- With the prefill eager, a row whose prompt is short (FED_PROMPT_TOKENS) joins without one: its prompt's tokens go
  through its slot's next steps, a token a step (the slot's count runs from minus the tokens still to feed), nothing
  sampled until the step that reads its last token samples its first, with the draws and the behaviour log-prob its
  prefill would have given it.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from worker.decoding.shapes import static_buffer
from worker.decoding.slot_cache import SPARE_COLUMNS, SlotCache, SlotState

# Eager (on a CPU), a prefill call costs about a quarter of a step of 128 slots whatever its rows, mostly transformers'
# Python, for the one to three rows that join at once: a prompt of up to this many tokens costs fewer row-steps fed
# through the steps, a token a step, in its slot (docs/performance.md, "Continuous batching"). Compiled (CUDA), every
# prompt is prefilled.
FED_PROMPT_TOKENS = 8
PREFILL_FEW_ROWS = 8  # the compiled prefill's smaller size (on CUDA about as many rows as end between two looks)


class SlotJoining:
    """The engine's methods that put waiting rows into free slots, free them and move rows (ContinuousDecoding's
    attributes throughout)."""

    def _admit(self) -> None:
        """Waiting rows into free slots: those whose prompts are fed through the steps (up to
        ``fed_prompt_tokens``); those whose group's prompt is in a slot already, by a copy of its keys and values;
        and the others, one row of each group prefilled (up to a job's rows a prefill; compiled, padded up to one of
        ``prefill_sizes``: a cache and a graph each, whatever the number of rows joining), its group's other
        joining rows copying its prompt."""
        while self.waiting and self.free:
            n = min(len(self.waiting), len(self.free), self.rows_per_job)
            joining, self.waiting = self.waiting[:n], self.waiting[n:]
            fed, prefilled, copied = [], [], []
            for job, row in joining:
                if len(job.prompt_ids[row]) <= self.fed_prompt_tokens:
                    fed.append((job, row))
                elif self.share_prompts and (job.seated_sibling(row) is not None or any(
                        j is job and j.group[r] == job.group[row] for j, r in prefilled)):
                    copied.append((job, row))
                else:
                    prefilled.append((job, row))
            if fed:
                self._feed(fed)
            if prefilled:
                n = len(prefilled)
                self._prefill(prefilled, next(size for size in self.prefill_sizes if size >= n)
                              if self.pads_prefills else n)
            if copied:
                self._copy_prompts(copied)

    def _feed(self, joining: list[tuple]) -> None:
        """``joining`` ((job, row) pairs) into free slots, their prompts fed through the next steps a token a step (on
        a CPU, an eager prefill costs a few steps' rows a call: see FED_PROMPT_TOKENS)."""
        slots, self.free = self.free[:len(joining)], self.free[len(joining):]
        ids, mask = self._padded_prompts([job.prompt_ids[row] for job, row in joining], self.prompt_part)
        lengths = mask.sum(-1)
        seeds = torch.tensor([job.seeds[row] for job, row in joining], dtype=torch.long)
        first = ids.gather(1, (self.prompt_part - lengths)[:, None])[:, 0]
        index, ids, mask, seeds = (t.to(self.device) for t in (torch.tensor(slots), ids, mask, seeds))
        if self.cache is None:
            self._allocated_prefill_cache(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
        st = self.state
        self._reset(st, index, ids, mask, seeds)
        st.prompt.index_copy_(0, index, ids)
        st.last.index_copy_(0, index, first.to(self.device))
        st.count.index_copy_(0, index, (1 - lengths).to(self.device))
        st.position.index_fill_(0, index, 0)
        self.prompt_tokens += int(lengths.sum())
        # Its token 0 is sampled by step steps + length - 1, token 1 by the one after.
        self._seated(joining, slots, [self.steps + length for length in lengths.tolist()])

    def _prefill(self, joining: list[tuple], rows: int) -> None:
        """``joining`` ((job, row) pairs) into free slots, in a prefill of ``rows`` rows: the last joining row repeated
        to fill it."""
        slots, self.free = self.free[:len(joining)], self.free[len(joining):]
        rows_in = joining + joining[-1:] * (rows - len(joining))
        prompts = [job.prompt_ids[row] for job, row in rows_in]
        # Compiled, one width (the prompt part); eager, the longest prompt's (on a CPU a prompt's padding costs as
        # much as its tokens).
        width = self.prompt_part if self.pads_prefills else max(len(p) for p in prompts)
        ids, mask = self._padded_prompts(prompts, width)
        position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate's positions
        seeds = torch.tensor([job.seeds[row] for job, row in rows_in], dtype=torch.long)
        st = self.state
        in_slots = torch.tensor(slots + slots[-1:] * (rows - len(joining)))
        args = [t.to(self.device) for t in (ids, mask, position, in_slots, seeds)]
        cache = self.prefill_caches.get((rows, width))
        if cache is not None:
            cache.reset()
            logits = self._compiled_prefill(cache, st, *args)
        else:
            # transformers allocates a static cache's tensors at their first write and marks their addresses static
            # only outside a compiled region: a shape's first prefill runs eagerly. Eager prefills keep no cache (one
            # for every number of rows and width would add up).
            if self.cache is None:
                cache = self._allocated_prefill_cache(*args[:3])  # (and the slots' cache, shaped as the model's keys)
            else:
                cache = StaticCache(config=self.model.config, max_cache_len=width)
            if self.pads_prefills:
                self.prefill_caches[rows, width] = cache
            logits = self._prefill_step(cache, st, *args)
        self.row_steps += rows
        self.prompt_tokens += rows * width
        if self.share_prompts:  # (cloned: a CUDA graph's output is overwritten by its next replay)
            for i, (job, row) in enumerate(joining):
                job.first_logits[job.group[row]] = logits[i].clone()
        self._seated(joining, slots, [self.steps] * len(joining))  # (token 1 by the first step after the prefill)

    def _copy_prompts(self, joining: list[tuple]) -> None:
        """``joining`` ((job, row) pairs) into free slots, each a copy of a slot of its group that holds its prompt
        (its keys, values and mask over the prompt part; the position after it), its first token chosen from its
        group's first logits with its own draws: the tokens and log-probs of a prefill of its own."""
        slots, self.free = self.free[:len(joining)], self.free[len(joining):]
        origins = [job.seated_sibling(row) for job, row in joining]
        prompts = [job.prompt_ids[row] for job, row in joining]
        ids, mask = self._padded_prompts(prompts)
        seeds = torch.tensor([job.seeds[row] for job, row in joining], dtype=torch.long)
        index, origin, ids, mask, seeds = (t.to(self.device) for t in (torch.tensor(slots), torch.tensor(origins),
                                                                        ids, mask, seeds))
        part = self.prompt_part
        for buffer in (*self.cache.keys, *self.cache.values):  # [slots, heads, columns, dim]
            prompt = buffer.narrow(2, 0, part)
            prompt.index_copy_(0, index, prompt.index_select(0, origin))
        st = self.state
        self._reset(st, index, ids, mask, seeds)
        prompt_mask = st.mask.narrow(1, 0, part)
        prompt_mask.index_copy_(0, index, prompt_mask.index_select(0, origin))
        st.count.index_fill_(0, index, 0)
        st.position.index_copy_(0, index, torch.tensor([len(p) for p in prompts], device=self.device))
        logits = torch.stack([job.first_logits[job.group[row]] for job, row in joining])
        self._choose(logits, st, index)
        self.row_steps += len(joining)  # (a row's first token sampled, without a forward)
        self._seated(joining, slots, [self.steps] * len(joining))

    def _seated(self, joining: list[tuple], slots: list[int], joined: list[int]) -> None:
        """``joining`` now decode in ``slots``, each row's token 1 sampled by the step of ``joined``."""
        for (job, row), slot, step in zip(joining, slots, joined, strict=True):
            job.slots[row], job.joined[row], job.runs[row] = slot, step, [(0, self.version)]
            self.owners[slot] = (job, row)

    def _allocated_prefill_cache(self, ids, mask, position) -> StaticCache:
        """A prefill's cache, allocated by a forward (which also shows the keys' dtype and heads as the model makes
        them, for the slots' cache)."""
        cache = StaticCache(config=self.model.config, max_cache_len=ids.size(1))
        self.model(input_ids=ids, attention_mask=mask, position_ids=position, cache=cache, use_cache=True,
                   logits_to_keep=1)
        cache.reset()
        if self.cache is None:
            keys, values = [], []
            for layer in cache.layers:
                for kind, into in ((layer.keys, keys), (layer.values, values)):
                    into.append(static_buffer(self.slots, kind.size(1), self.reads.size + SPARE_COLUMNS, kind.size(3),
                                              dtype=kind.dtype, device=self.device))
            self.cache = SlotCache(keys, values, self.state.column)
        return cache

    # ------------------------------------------------------------------ leaving and moving

    def _drop(self, job) -> None:
        """Frees a job's slots as they are (its rows' tokens are not wanted)."""
        slots = [slot for slot in job.slots if slot is not None]
        self.state.active.index_fill_(0, torch.tensor(slots, device=self.device), False)
        for slot in slots:
            del self.owners[slot]
        self._freed(slots)

    def _freed(self, slots: list[int]) -> None:
        self.free = sorted(self.free + slots)  # (joining rows take the slots that read fewest columns first)

    def _move(self, moves: list[tuple[int, int]]) -> None:
        """Rows from slot to slot, with their keys, values and state (SlotReads.plan's moves: each to a free slot, or
        two swapping)."""
        st = self.state
        origins, slots = (torch.tensor(ends, device=self.device) for ends in zip(*moves, strict=True))
        for buffer in (*self.cache.keys, *self.cache.values, *(t for t in vars(st).values() if t is not None)):
            buffer.index_copy_(0, slots, buffer.index_select(0, origins))
        owners = {to: self.owners.pop(origin) for origin, to in moves}
        self.owners.update(owners)
        for slot, (job, row) in owners.items():
            job.slots[row] = slot
        vacated = sorted({origin for origin, _ in moves} - owners.keys())
        if vacated:
            index = torch.tensor(vacated, device=self.device)
            st.active.index_fill_(0, index, False)
            st.position.index_fill_(0, index, 0)  # (as collect does for a freed slot)
            self.free = sorted(set(self.free) - owners.keys() | set(vacated))

    # ------------------------------------------------------------------ inside the prefill's graph

    def _prefill_step(self, cache: StaticCache, st: SlotState, ids, mask, position, slots, seeds
                      ) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position, cache=cache, use_cache=True,
                         logits_to_keep=1)
        # The prompt ends at the prompt part's end, where the row's first token goes.
        width = ids.size(1)
        columns = torch.arange(self.prompt_part - width, self.prompt_part, device=ids.device)
        for small, keys, values in zip(cache.layers, self.cache.keys, self.cache.values, strict=True):
            keys.transpose(1, 2).index_put_((slots[:, None], columns[None, :]), small.keys.transpose(1, 2))
            values.transpose(1, 2).index_put_((slots[:, None], columns[None, :]), small.values.transpose(1, 2))
        self._reset(st, slots, ids, mask, seeds)
        st.mask.index_put_((slots[:, None], columns[None, :]), mask.bool())
        st.count.index_fill_(0, slots, 0)
        st.position.index_copy_(0, slots, position[:, -1] + 1)  # the first token's, fed to the next step
        logits = out.logits[:, -1, :].float()
        self._choose(logits, st, slots)
        return logits

    def _reset(self, st: SlotState, slots, ids, mask, seeds) -> None:
        """The state of ``slots``, which rows of prompts ``ids`` join (left-padded, ``mask``), for their first step."""
        st.mask.index_fill_(0, slots, False)
        st.seed.index_copy_(0, slots, seeds)
        st.ended.index_fill_(0, slots, False)
        st.active.index_fill_(0, slots, True)
        st.tokens.index_fill_(0, slots, self.pad)
        st.logps.index_fill_(0, slots, 0.0)
        if st.seen is not None:
            st.seen.index_fill_(0, slots, False)
            # The prompt's tokens, not its padding (transformers' prompt_ignore_length): padding to the extra column.
            prompt_tokens = ids.masked_fill(mask == 0, self.vocab)
            st.seen.index_put_((slots[:, None], prompt_tokens), torch.ones_like(prompt_tokens, dtype=torch.bool))
