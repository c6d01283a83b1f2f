"""The continuous engine's runner (worker/decoding/continuous.py): it carries out the scheduler's plans
(worker/decoding/scheduler.py) on the slots' cache and state (worker/decoding/slot_cache.py), and runs the steps.

How rows join their slots (``join``):

- ``prefilled``: the joining rows (prompts padded on the left, as TRL pads them) run over a cache of their own, then
  their keys and values go into their slots' prompt columns (the prompt ends at the prompt part's end) and their
  first tokens are chosen. Eager (the CPU default), a prefill takes the rows that join at once as they are, padded to
  the longest prompt (a new cache each call; one call, not several: on the CPU machine a call costs 4-6 ms whatever
  its rows, most of it transformers' Python). Compiled (the CUDA default), each shape is a graph to compile (tens of
  seconds at 0.5B's shape), so there are two, PREFILL_FEW_ROWS and a job's rows by the prompt part, the joining rows
  padded up to the smaller that holds them by repeating the last (the same inputs, written to the same slot: the same
  values).
- ``copied``: a row of a group (TRL's G generations of one prompt) whose prompt a sibling's slot holds copies that
  slot's prompt columns (keys, values, mask) into its own, its first token sampled from the group's prefill's last
  logits (kept while the job is in the engine) with its own draws: the tokens and log-probs of a prefill of its own.
- ``fed``: with the prefill eager, a short prompt (FED_PROMPT_TOKENS) goes through its slot's next steps, a token a
  step (the slot's count runs from minus the tokens still to feed), nothing sampled until the step that reads its
  last token samples its first, with the draws and the behaviour log-prob its prefill would have given it.

A step (``_step``, compiled: the whole forward, the logits-to-token function of worker/decoding/step.py and the
bookkeeping) gives every slot one token; the slots read the columns the plan says: by ranges of slots (a graph), or
every slot the same first columns of the first slots (one graph, its numbers of rows and columns variables).
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from worker.decoding.seeded_draws import seeded_exponentials
from worker.decoding.sequence import Joining, Sequence
from worker.decoding.shapes import bucketed, static_buffer
from worker.decoding.slot_cache import SPARE_COLUMNS, Plan, SlotCache, SlotReads, SlotState, StepPlan, first_columns
from worker.decoding.step import OwnStep, next_token

# Eager (on a CPU), a prefill call costs about a quarter of a step of 128 slots whatever its rows, mostly transformers'
# Python, for the one to three rows that join at once: a prompt of up to this many tokens costs fewer row-steps fed
# through the steps, a token a step, in its slot (docs/performance.md, "Continuous batching"). Compiled (CUDA), every
# prompt is prefilled.
FED_PROMPT_TOKENS = 8
PREFILL_FEW_ROWS = 8  # the compiled prefill's smaller size (on CUDA about as many rows as end between two looks)
# Up to how many times a step may halve the rows it computes when few slots hold rows (slot_cache.py; never under
# NARROWEST_STEP rows). On the CPU machine a step costs about in proportion to its rows (at the `larger` shape
# reading the whole cache: 21.6 ms at 128 rows, 9.5 at 64, 4.3 at 32, 2.6 at 16); the fourth halving (8 of 128)
# raised the utilisation over a 24-job long-tail stream from 0.886 to 0.896, the same one graph. On a GPU a step of a
# small model is bound by its kernels' launches, hardly by its rows, and the narrower steps would be graphs to record
# (CUDA graphs take no variable shape).
NARROWER_STEPS = {"cuda": 0, "cpu": 4}


class SlotRunner(OwnStep):
    """The model, the slots' cache and state, and the compiled step and prefill over them."""

    def __init__(self, trainer, slots: int, compile: bool, compile_prefill: bool | None, compile_mode: str | None,
                 fuse: bool):
        self.trainer, self.slots, self.rows_per_job = trainer, slots, trainer.args.generation_batch_size
        self._set_up_step(trainer, compile, compile_prefill, compile_mode, fuse)
        self._compiled_sized_step = self._compiled(self._sized_step, dynamic=None)  # (rows, columns: variables)
        self.row_steps = 0  # rows computed: slots x steps, plus each prefill's rows and each row copying one
        self.prompt_tokens = 0  # prompt tokens computed: each prefill's rows x columns, and fed prompts' tokens
        self.prefill_compiled = self._compiled_prefill != self._prefill_step  # (on CUDA by default)
        # Compiled, a prefill's rows are padded up to one of prefill_sizes and its columns to the prompt part (a shape,
        # a graph each); eager, it takes the joining rows as they are, as wide as their longest prompt.
        self.pads_prefills = self.prefill_compiled
        self.fed_prompt_tokens = 0 if self.prefill_compiled else FED_PROMPT_TOKENS
        self.prefill_sizes = sorted({min(PREFILL_FEW_ROWS, self.rows_per_job), self.rows_per_job})

    def allocate(self, prompt_tokens: int) -> None:
        """The slots' state and the reads of caches for prompts of up to ``prompt_tokens`` tokens (the cache itself
        at the first prefill, with the dtype keys come in): new shapes, new graphs."""
        self.prompt_part = bucketed(prompt_tokens)
        self.reads = SlotReads(self.slots, self.prompt_part, self.max_new, NARROWER_STEPS.get(self.device.type, 0))
        self.state = SlotState(self.slots, self.prompt_part, self.max_new, self.device,
                               self.vocab if self.sampling.repetition_penalty is not None else None)
        self.narrowed: dict[int, tuple[SlotCache, SlotState]] = {}  # by width: the first slots' cache and state
        self.mask_reads: dict[tuple[int, int], torch.Tensor] = {}  # by width and columns: their mask's first columns
        self.prefill_caches: dict[tuple[int, int], StaticCache] = {}  # compiled: by a prefill's rows and columns
        self.cache: SlotCache | None = None

    # ------------------------------------------------------------------ carrying out plans

    def join(self, joining: Joining) -> None:
        if self.cache is None:  # (shaped as the model makes its keys: at the first join, under the caller's autocast)
            self._allocate_slot_cache()
        {"fed": self._feed, "prefilled": self._prefill, "copied": self._copy_prompts}[joining.how](joining)

    def run(self, plan: StepPlan, steps: int) -> None:
        """``steps`` steps by ``plan`` (the scheduler's), after its moves."""
        if plan.moves:
            self._move(plan.moves, plan.vacated)
        step, *inputs = self.step_over(plan.width, plan.reads)
        for _ in range(steps):
            step(*inputs)
        self.row_steps += steps * plan.width

    def step_over(self, width: int, reads: Plan) -> tuple:
        """The compiled step over the first ``width`` slots by ``reads``, and the cache, state and plan it takes: by
        ranges of slots, the whole cache and state; every slot reading the same columns, views of the first slots
        and of the mask's first columns (made once: a graph's inputs), whose numbers are variables of one graph."""
        if isinstance(reads, tuple):
            return self._compiled_step, self.cache, self.state, reads
        if width not in self.narrowed:
            state = self.state.narrowed(width)
            self.narrowed[width] = (self.cache.narrowed(state.column), state)
        cache, state = self.narrowed[width]
        if (width, reads) not in self.mask_reads:
            self.mask_reads[width, reads] = first_columns(state.mask, reads)
        return self._compiled_sized_step, cache, state, self.mask_reads[width, reads]

    def ended_rows(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The rows that ended, by slot: their tokens and behaviour log-probs on the CPU; their slots freed. One
        device sync, and a copy when rows ended."""
        st = self.state
        slots = (st.ended & st.active).nonzero()[:, 0].cpu().tolist()  # the device sync
        if not slots:
            return {}
        index = torch.tensor(slots, device=self.device)
        counts = st.count.index_select(0, index).cpu().tolist()
        tokens = st.tokens.index_select(0, index).cpu()
        logps = st.logps.index_select(0, index).cpu()
        self.free(slots)
        return {slot: (tokens[i, :counts[i]], logps[i, :counts[i]]) for i, slot in enumerate(slots)}

    def free(self, slots: list[int]) -> None:
        if slots:
            index = torch.tensor(slots, device=self.device)
            self.state.active.index_fill_(0, index, False)
            self.state.position.index_fill_(0, index, 0)  # (a free slot's position would otherwise grow without end)

    def decoding_tokens(self) -> int:
        """Tokens sampled so far by the rows in the slots (one device sync; a row still fed its prompt has sampled
        none)."""
        st = self.state
        return int(st.count.clamp(min=0).masked_fill(~st.active, 0).sum())

    def _move(self, moves: list[tuple[int, int]], vacated: list[int]) -> None:
        """Rows from slot to slot, with their keys, values and state (SlotReads.plan's moves: each to a free slot, or
        two swapping)."""
        origins, slots = (torch.tensor(ends, device=self.device) for ends in zip(*moves, strict=True))
        for buffer in (*self.cache.keys, *self.cache.values, *(t for t in vars(self.state).values() if t is not None)):
            buffer.index_copy_(0, slots, buffer.index_select(0, origins))
        self.free(vacated)

    # ------------------------------------------------------------------ joining

    def _feed(self, joining: Joining) -> None:
        """Rows whose prompts are fed through their slots' next steps, a token a step."""
        ids, mask = self._padded_prompts([job.prompt_ids[row] for job, row in joining.rows], self.prompt_part)
        lengths = mask.sum(-1)
        seeds = torch.tensor([job.seeds[row] for job, row in joining.rows], dtype=torch.long)
        first = ids.gather(1, (self.prompt_part - lengths)[:, None])[:, 0]
        index, ids, mask, seeds = (t.to(self.device) for t in (torch.tensor(joining.slots), ids, mask, seeds))
        st = self.state
        self._reset(st, index, ids, mask, seeds)
        st.prompt.index_copy_(0, index, ids)
        st.last.index_copy_(0, index, first.to(self.device))
        st.count.index_copy_(0, index, (1 - lengths).to(self.device))
        st.position.index_fill_(0, index, 0)
        self.prompt_tokens += int(lengths.sum())

    def _prefill(self, joining: Joining) -> None:
        """Rows prefilled together, in a prefill of ``joining.size`` rows (the last row repeated to fill it)."""
        rows, padding = joining.size, joining.size - len(joining.rows)
        rows_in = joining.rows + joining.rows[-1:] * padding
        prompts = [job.prompt_ids[row] for job, row in rows_in]
        # Compiled, one width (the prompt part); eager, the longest prompt's (on a CPU a prompt's padding costs as
        # much as its tokens).
        width = self.prompt_part if self.pads_prefills else max(len(p) for p in prompts)
        ids, mask = self._padded_prompts(prompts, width)
        position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate's positions
        seeds = torch.tensor([job.seeds[row] for job, row in rows_in], dtype=torch.long)
        st = self.state
        in_slots = torch.tensor(joining.slots + joining.slots[-1:] * padding)
        args = [t.to(self.device) for t in (ids, mask, position, in_slots, seeds)]
        cache = self.prefill_caches.get((rows, width))
        if cache is not None:
            cache.reset()
            logits = self._compiled_prefill(cache, st, *args)
        else:
            # transformers allocates a static cache's tensors at their first write and marks their addresses static
            # only outside a compiled region: a shape's first prefill runs eagerly. Eager prefills keep no cache (one
            # for every number of rows and width would add up).
            cache = StaticCache(config=self.model.config, max_cache_len=width)
            if self.pads_prefills:
                self.prefill_caches[rows, width] = cache
            logits = self._prefill_step(cache, st, *args)
        self.row_steps += rows
        self.prompt_tokens += rows * width
        for i, (job, row) in enumerate(joining.rows):
            if job.group[row] in job.prefilled:  # (cloned: a CUDA graph's output is overwritten by its next replay)
                job.first_logits[job.group[row]] = logits[i].clone()

    def _copy_prompts(self, joining: Joining) -> None:
        """Rows that copy a sibling's slot's prompt (keys, values and mask over the prompt part; the position after
        it), each first token chosen from its group's first logits with its own draws."""
        prompts = [job.prompt_ids[row] for job, row in joining.rows]
        ids, mask = self._padded_prompts(prompts)
        seeds = torch.tensor([job.seeds[row] for job, row in joining.rows], dtype=torch.long)
        index, origin, ids, mask, seeds = (t.to(self.device) for t in (
            torch.tensor(joining.slots), torch.tensor(joining.origins), ids, mask, seeds))
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
        logits = torch.stack([job.first_logits[job.group[row]] for job, row in joining.rows])
        self._choose(logits, st, index)
        self.row_steps += len(joining.rows)  # (a row's first token sampled, without a forward)

    def _allocate_slot_cache(self) -> None:
        """The slots' cache, its keys and values shaped and typed as the model makes them: a forward of one token
        over a cache of one column shows them (a prompt's forward would cost a prefill more at a worker's start)."""
        probe = StaticCache(config=self.model.config, max_cache_len=1)
        token = torch.full((1, 1), self.pad, device=self.device)
        self.model(input_ids=token, attention_mask=torch.ones_like(token), position_ids=torch.zeros_like(token),
                   cache=probe, use_cache=True, logits_to_keep=1)
        keys, values = [], []
        for layer in probe.layers:
            for kind, into in ((layer.keys, keys), (layer.values, values)):
                into.append(static_buffer(self.slots, kind.size(1), self.reads.size + SPARE_COLUMNS, kind.size(3),
                                          dtype=kind.dtype, device=self.device))
        self.cache = SlotCache(keys, values, self.state.column)

    def warm_up_prefill(self, rows: list[tuple[Sequence, int]]) -> None:
        """A prefill of ``rows`` into the first slots, to compile it: its rows are not kept."""
        self.join(Joining("prefilled", rows, list(range(len(rows))), len(rows)))
        self.free(list(range(len(rows))))

    # ------------------------------------------------------------------ inside the graphs

    def _sized_step(self, cache: SlotCache, st: SlotState, reads: torch.Tensor) -> None:
        """``_step`` over views of the first slots, every slot attending to the columns of ``reads`` (a function of
        its own: torch.compile keeps its graphs apart)."""
        self._step(cache, st, reads)

    def _step(self, cache: SlotCache, st: SlotState, plan: Plan | torch.Tensor) -> None:
        """One token per slot, each range of slots attending to the cache's first columns as ``plan`` says (Python
        ints: a graph each); or every slot to as many as ``plan``, a view of the mask's first columns, has (its
        width and its rows variables of one graph)."""
        # A row's token i - 1 (fed now, i sampled) goes into column prompt part + i - 1.
        st.column.copy_(st.count + (self.prompt_part - 1))
        if isinstance(plan, torch.Tensor):
            # Written through the view the step reads, never through st.mask as well: two inputs of a graph that
            # share memory, one written, become one "synthetic base" in AOTAutograd, which then keeps none of the
            # graph's inputs static (parameters and buffers copied at every CUDA graph replay, or no CUDA graph).
            # Every row's column lies among the view's (the scheduler's reach). A free slot keeps its last row's count,
            # so its column may lie past them: clamped (its mask is reset when a row joins). A row's is left as it is,
            # so that a plan too narrow for a row fails on its index rather than writing elsewhere.
            columns = plan.size(1)
            mask, column = plan, torch.where(st.active, st.column, st.column.clamp(max=columns - 1))
        else:
            mask, columns, column = st.mask, plan, st.column
        mask.index_put_((cache.slots, column), torch.ones_like(st.active))  # (a slot attends to its token)
        out = self.model(input_ids=st.last[:, None], attention_mask=mask[:, None, None, :],
                         position_ids=st.position[:, None], cache=cache, use_cache=True, attention_columns=columns)
        self._choose(out.logits[:, -1, :].float(), st, None)

    def _choose(self, logits: torch.Tensor, st: SlotState, slots: torch.Tensor | None) -> None:
        """Processes the logits of ``slots`` (all when None), picks each row's token with its own draws, records it
        and its behaviour log-prob at the row's count, and advances the row."""
        def of(t):
            return t if slots is None else t.index_select(0, slots)

        count, ended = of(st.count), of(st.ended)
        feeding = count < 0  # its prompt's next token is fed to the next step: nothing is sampled
        live = of(st.active) & ~ended & ~feeding
        noise = seeded_exponentials(of(st.seed), count, logits.size(-1)) if self.sampling.do_sample else None
        token, logp = next_token(logits, self.sampling, self.eos, None if st.seen is None else of(st.seen), count,
                                 noise)
        token = torch.where(live, token, self.pad)
        logp = torch.where(live, logp, 0.0)
        count_after = count + (live | feeding).long()
        ended_after = ended | (live & (torch.isin(token, self.eos) | (count_after >= self.max_new)))
        rows = torch.arange(logits.size(0), device=logits.device) if slots is None else slots
        where = (rows, count.clamp(0, self.max_new))  # a row that ended writes into the spare last column
        st.tokens.index_put_(where, token)
        st.logps.index_put_(where, logp)
        if st.seen is not None:
            st.seen.index_put_((rows, token.masked_fill(~live, self.vocab)), torch.ones_like(token, dtype=torch.bool))
        if slots is None:
            prompt_next = st.prompt.gather(1, (count + self.prompt_part).clamp(max=self.prompt_part - 1)[:, None])
            st.count.copy_(count_after)
            st.ended.copy_(ended_after)
            st.last.copy_(torch.where(feeding, prompt_next[:, 0], token))
            st.position.add_(1)
        else:
            st.count.index_copy_(0, slots, count_after)
            st.ended.index_copy_(0, slots, ended_after)
            st.last.index_copy_(0, slots, token)

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
