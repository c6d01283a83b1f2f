"""Continuous batching (``--worker_decoding continuous``): a worker's decoding as an engine that keeps its rows
busy while jobs wait.

A fixed batch lasts as long as its longest row, and completion lengths have a long tail: most of its row-steps
decode rows that already ended. Here the batch is ``--decoding_slots`` row slots. A job's G rows wait in line for
slots and join one by one, each into the first free slot; each slot decodes on its own until its
row ends (EOS or the length cap), when its tokens are copied out and the slot takes the next waiting row at once. A
job whose rows have all ended leaves, to be scored while the others decode.

Shapes stay fixed, so the step and the prefills compile once (CUDA graphs on a GPU), as the graph decoder's
(worker/decoding/graph.py; the logits processing, sampling and behaviour log-prob of worker/decoding/step.py):

- each slot has its own columns of the KV cache, as a fixed batch's row (worker/decoding/slot_cache.py): a row's
  prompt ends at the prompt part's end and its i-th token goes after it, whenever it joined; attention reads each
  slot's own columns through its row of a mask. Ranges of slots read their own number of columns, rows moving to
  a range that reads more as they grow (one graph), or every slot reads the same bucket (``SlotReads``; one graph,
  its number of columns a variable); with few rows in the slots (on a CPU), a step computes only the first half,
  quarter or eighth of the slots, the rows moving into them (the buckets' graph, its number of rows a variable);
- a joining row is prefilled (compiled on a GPU: two shapes, a graph each) into its slot's prompt columns, once for
  the rows of its group (the others copy its columns), or, with the prefill eager (a CPU's), a short prompt is fed
  through its slot's next steps a token a step (worker/decoding/joining.py);
- a row's random draws depend on its job's seed, its row and its token's index only (``seeded_exponentials``, a
  counter-based hash): a job samples the same tokens whichever slots, whichever steps, and whichever other jobs it
  decodes beside.

Every ``check_every`` steps (CHECK_EVERY) the host reads which slots ended (one device sync), frees them, hands
finished jobs out, and looks for newer weights: they are synced in place between steps, and each row records the
versions that sampled its tokens (``runs``, as worker/in_flight.py defines them, one list a row: a job's rows
join at different steps; a job's weights_version is its oldest token's).

The worker's loop drives it through worker/generation.py's EngineGeneration (jobs joining, scoring on a thread of
its own while the slots decode, publishing).
"""

from __future__ import annotations

import time

import torch
from transformers import StaticCache

from worker.behaviour import BehaviourCapture
from worker.decoding import Generation
from worker.decoding.compiled_step import compiled_graphs
from worker.decoding.joining import FED_PROMPT_TOKENS, PREFILL_FEW_ROWS, SlotJoining
from worker.decoding.seeded_draws import row_seed, seeded_exponentials
from worker.decoding.sequence import FinishedJob, Sequence
from worker.decoding.shapes import bucketed
from worker.decoding.slot_cache import Plan, SlotCache, SlotReads, SlotState, first_columns
from worker.decoding.step import OwnStep, next_token

# Decoding steps between the host's looks at which rows ended: on a GPU each look is a device sync (the queue of
# launched steps drains). On a CPU a look is cheap, but each look that frees slots starts a prefill of the rows
# whose prompts are not fed through the steps (worker/decoding/joining.py), which costs mostly per call (4-6 ms at
# the `larger` shape against a 20-25 ms step): every second step halves the prefills, for half a step more per
# ended row (on the CPU machine with every prompt prefilled, about 3% more samples/s, utilisation 0.78 against
# 0.80: docs/performance.md, "Continuous batching").
CHECK_EVERY = {"cuda": 8, "cpu": 2}
# Up to how many times a step may halve the rows it computes when few slots hold rows (slot_cache.py). On the CPU
# machine a step costs about in proportion to its rows (at the `larger` shape reading the whole cache: 21.6 ms at
# 128 rows, 9.5 at 64, 4.3 at 32, 2.6 at 16). On a GPU a step of a small model is bound by its kernels' launches,
# hardly by its rows, and the narrower steps would be graphs to record (CUDA graphs take no variable shape).
NARROWER_STEPS = {"cuda": 0, "cpu": 3}

class ContinuousDecoding(SlotJoining, OwnStep):
    """The engine (see the module's docstring). ``add`` a job's rows, ``run`` steps, ``collect`` finished jobs."""

    mode = "continuous"

    WARM_UP_JOBS = 3  # the first prefill allocates the caches eagerly, the second compiles, the third records
    WARM_UP_CALLS = 2  # of each prefill size after the first (compiled: compiles, then records its CUDA graph)

    def __init__(self, trainer, slots: int, prompt_ids: list[list[int]], compile: bool = True,
                 compile_prefill: bool | None = None, compile_mode: str | None = None, fuse: bool = True,
                 share_prompts: bool = True):
        """``share_prompts``: a group's rows join by copying the keys and values of its prompt's one prefill (False:
        each row prefills its prompt, for comparison)."""
        self.trainer = trainer
        self.share_prompts = share_prompts
        self.rows_per_job = trainer.args.generation_batch_size
        if slots < self.rows_per_job:
            raise ValueError(f"--decoding_slots {slots} cannot hold one job's {self.rows_per_job} rows")
        self.slots = self.rows_per_call = slots
        self._set_up_step(trainer, compile, compile_prefill, compile_mode, fuse)
        self._compiled_sized_step = self._compiled(self._sized_step, dynamic=None)  # (rows, columns: variables)
        self.check_every = CHECK_EVERY.get(self.device.type, 8)
        self.residents: list[Sequence] = []
        self.owners: dict[int, tuple[Sequence, int]] = {}  # slot: the job and row it decodes
        self.free: list[int] = list(range(slots))
        self.waiting: list[tuple[Sequence, int]] = []  # rows waiting for a slot: (job, row), in the order they came
        self.steps = 0  # decoding steps run, over every slot
        self.row_steps = 0  # rows computed: slots x steps, plus each prefill's rows and each row copying one
        self.kept_tokens = 0  # tokens of the rows that ended (the rest of the row-steps decoded nothing kept)
        self.prompt_tokens = 0  # prompt tokens computed: each prefill's rows x columns, and fed prompts' tokens
        self.version: int | None = None  # the weights the model holds
        self.graphs_after_warm_up: int | None = None
        self.warm_up_graphs = 0  # graphs its warm-up compiled
        self._allocate(max((len(ids) for ids in prompt_ids), default=1))
        self.prefill_compiled = self._compiled_prefill != self._prefill_step  # (on CUDA by default)
        # Compiled, a prefill's rows are padded up to one of prefill_sizes and its columns to the prompt part (a shape,
        # a graph each); eager, it takes the joining rows as they are, as wide as their longest prompt.
        self.pads_prefills = self.prefill_compiled
        self.fed_prompt_tokens = 0 if self.prefill_compiled else FED_PROMPT_TOKENS
        self.prefill_sizes = sorted({min(PREFILL_FEW_ROWS, self.rows_per_job), self.rows_per_job})

    @staticmethod
    def unsupported(trainer) -> str | None:
        """Why the engine cannot generate for this trainer (the worker then decodes as ``graph`` would), or None."""
        why = OwnStep.unsupported(trainer)
        if why is not None:
            return why
        if getattr(trainer.args, "max_staleness", None) == 0:
            return "synchronous mode (--max_staleness 0: a job is generated by one version)"
        if trainer.beta != 0.0 and trainer.args.use_peft:
            return "--beta with an adapter (TRL's reference log-probs disable the adapter the engine decodes with)"
        if not hasattr(trainer.processing_class, "convert_tokens_to_ids"):
            return "a processor (prompts that may carry images)"
        return None

    # ------------------------------------------------------------------ shapes

    def reallocate(self, prompt_tokens: int) -> None:
        """Caches for prompts of up to ``prompt_tokens`` tokens (the engine is empty): new shapes, new graphs."""
        assert not self.residents, "reallocating with jobs in the slots"
        self._allocate(prompt_tokens)
        self.free, self.waiting = list(range(self.slots)), []

    def _allocate(self, prompt_tokens: int) -> None:
        self.prompt_part = bucketed(prompt_tokens)
        self.reads = SlotReads(self.slots, self.prompt_part, self.max_new, NARROWER_STEPS.get(self.device.type, 0))
        self.state = SlotState(self.slots, self.prompt_part, self.max_new, self.device,
                               self.vocab if self.sampling.repetition_penalty is not None else None)
        self.narrowed: dict[int, tuple[SlotCache, SlotState]] = {}  # by width: the first slots' cache and state
        self.mask_reads: dict[tuple[int, int], torch.Tensor] = {}  # by width and columns: their mask's first columns
        self.prefill_caches: dict[tuple[int, int], StaticCache] = {}  # compiled: by a prefill's rows and columns
        self.cache: SlotCache | None = None  # allocated at the first prefill, with the dtype keys come in

    def fits(self, prompt_ids: list[list[int]]) -> bool:
        return max(len(ids) for ids in prompt_ids) <= self.prompt_part

    def wants_a_job(self) -> bool:
        """A slot is free and no row waits for one: a job claimed now starts decoding at once (never earlier: a
        claimed job ages)."""
        return bool(self.free) and not self.waiting

    def empty(self) -> bool:
        return not self.residents

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
        st.mask.index_put_((cache.slots, st.column), torch.ones_like(st.active))  # (a slot attends to its token)
        mask, columns = (plan, plan.size(1)) if isinstance(plan, torch.Tensor) else (st.mask, plan)
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

    # ------------------------------------------------------------------ on the host

    def add(self, key, prompt_ids: list[list[int]], job_seed: int) -> None:
        """A job's rows wait in line for slots; those that find one join at once (the caller checked ``fits``)."""
        rows = len(prompt_ids)
        if rows != self.rows_per_job:
            raise ValueError(f"a job of {rows} rows for an engine of {self.rows_per_job}-row jobs")
        job = Sequence(key, [list(p) for p in prompt_ids], [row_seed(job_seed, r) for r in range(rows)],
                        added_step=self.steps)
        self.residents.append(job)
        self.waiting += [(job, row) for row in range(rows)]
        self._admit()

    def run(self, steps: int) -> None:
        """``steps`` decoding steps over the slots that hold rows, after the waiting rows that find a free slot
        join."""
        self._admit()
        # A row reads its prompt's columns and one more a step from the one it joined at (its first token's).
        reach = {slot: min(self.reads.size, self.prompt_part + self.steps + steps - job.joined[row])
                 for slot, (job, row) in self.owners.items()}
        width, plan, moves = self.reads.plan(reach)
        if moves:
            self._move(moves)
        step, *inputs = self._step_over(width, plan)
        for _ in range(steps):
            step(*inputs)
        self.steps += steps
        self.row_steps += steps * width

    def _step_over(self, width: int, plan: Plan) -> tuple:
        """The compiled step over the first ``width`` slots by ``plan``, and the cache, state and plan it takes: by
        ranges of slots, the whole cache and state; every slot reading the same columns, views of the first slots
        and of the mask's first columns (made once: a graph's inputs), whose numbers are variables of one graph."""
        if isinstance(plan, tuple):
            return self._compiled_step, self.cache, self.state, plan
        if width not in self.narrowed:
            state = self.state.narrowed(width)
            self.narrowed[width] = (self.cache.narrowed(state.column), state)
        cache, state = self.narrowed[width]
        if (width, plan) not in self.mask_reads:
            self.mask_reads[width, plan] = first_columns(state.mask, plan)
        return self._compiled_sized_step, cache, state, self.mask_reads[width, plan]

    def collect(self) -> list[FinishedJob]:
        """Frees the slots of the rows that have ended (their tokens copied out) and returns the jobs whose rows have
        all ended. One device sync, and a copy when rows ended."""
        if not self.residents:
            return []
        st = self.state
        ended_slots = (st.ended & st.active).nonzero()[:, 0].cpu().tolist()  # the device sync
        if ended_slots:
            index = torch.tensor(ended_slots, device=self.device)
            counts = st.count.index_select(0, index).cpu().tolist()
            tokens = st.tokens.index_select(0, index).cpu()
            logps = st.logps.index_select(0, index).cpu()
            st.active.index_fill_(0, index, False)
            st.position.index_fill_(0, index, 0)  # (a free slot's position would otherwise grow without end)
            self._freed(ended_slots)
            for i, slot in enumerate(ended_slots):
                job, row = self.owners.pop(slot)
                job.ended[row] = (tokens[i, :counts[i]], logps[i, :counts[i]])
                job.slots[row] = None
                self.kept_tokens += counts[i]
        finished = []
        for job in [j for j in self.residents if len(j.ended) == len(j.slots)]:
            self.residents.remove(job)
            rows = [job.ended[row] for row in range(len(job.slots))]
            width = max(len(t) for t, _ in rows)
            tokens = torch.full((len(rows), width), self.pad, dtype=torch.long)
            logps = torch.zeros((len(rows), width), dtype=torch.float32)
            for i, (t, lp) in enumerate(rows):
                tokens[i, :len(t)], logps[i, :len(lp)] = t, lp
            runs = [[(first, version) for first, version in job.runs[row] if first < max(len(t), 1)]
                    for row, (t, _) in enumerate(rows)]
            finished.append(FinishedJob(job.key, job.prompt_ids, [t.tolist() for t, _ in rows], tokens, logps, runs,
                                        time.monotonic() - job.added_at, self.steps - job.added_step))
        return finished

    def generate(self, prompt_ids: list[list[int]], seed: int, in_flight: None = None) -> Generation:
        """The engine as one decoder call (worker/decoding's interface: tests and benchmarks): the rows as jobs of
        ``rows_per_job`` rows, job i seeded from ``seed`` and i, their rows joining as slots free up, until every row
        has ended. The worker's continuous loop drives the engine itself, and syncs newer weights between
        its steps itself: ``in_flight`` is not taken."""
        if in_flight is not None:
            raise ValueError("the engine syncs newer weights between its steps itself (worker/generation.py)")
        if len(prompt_ids) % self.rows_per_job or not self.empty():
            raise ValueError(f"{len(prompt_ids)} rows for an engine of {self.rows_per_job}-row jobs, "
                             f"{len(self.residents)} jobs in it")
        if not self.fits(prompt_ids):
            self.reallocate(max(len(ids) for ids in prompt_ids))
        jobs = [prompt_ids[i:i + self.rows_per_job] for i in range(0, len(prompt_ids), self.rows_per_job)]
        for key, rows in enumerate(jobs):
            self.add(key, rows, seed if key == 0 else row_seed(seed, -key))
        finished = {}
        while not self.empty():
            self.run(self.check_every)
            finished.update((job.key, job) for job in self.collect())
        ordered = [finished[key] for key in range(len(jobs))]
        width = max(job.tokens.size(1) for job in ordered)
        tokens = torch.cat([torch.nn.functional.pad(job.tokens, (0, width - job.tokens.size(1)), value=self.pad)
                            for job in ordered])
        logps = torch.cat([torch.nn.functional.pad(job.logps, (0, width - job.logps.size(1))) for job in ordered])
        behaviour = BehaviourCapture(self.trainer)
        behaviour.given(tokens, logps)
        return Generation([ids for job in ordered for ids in job.completion_ids], behaviour)

    def weights_changed(self, version: int) -> None:
        """The model now holds ``version``: each decoding row's next token is sampled by it (a waiting row's first)."""
        self.version = version
        for job in self.residents:
            for row, slot in enumerate(job.slots):
                if slot is None:
                    continue
                first = max(0, self.steps - job.joined[row] + 1)  # the row's next token's index (0: its first's)
                runs = job.runs[row]
                if runs[-1][0] == first:
                    runs[-1] = (first, version)
                else:
                    runs.append((first, version))

    def decoded_tokens(self) -> int:
        """Tokens sampled so far, by the rows that ended and those still decoding (one device sync; a row still fed
        its prompt has sampled none)."""
        st = self.state
        return self.kept_tokens + int(st.count.clamp(min=0).masked_fill(~st.active, 0).sum())

    def utilisation(self) -> float:
        """Row-steps that produced a kept token over row-steps computed (so far)."""
        return self.kept_tokens / self.row_steps if self.row_steps else 0.0

    def warm_up(self, prompt_ids: list[list[int]]) -> float:
        """Compiles the step and every prefill size: WARM_UP_JOBS jobs of ``prompt_ids``' first rows one after the
        other, each dropped after a look's steps (decoding them to their ends cost a stream's tail: 9.6 s of a
        33 s warm warm-up, profiled, at a cap of 512 on a CPU), then, with the prefill compiled, WARM_UP_CALLS
        prefills of each other size, their rows dropped, and WARM_UP_CALLS + 1 of each step (``SlotReads.steps``,
        with no row in the slots). Returns the seconds it took."""
        start, graphs_before = time.monotonic(), compiled_graphs()
        rows = (prompt_ids * self.rows_per_job)[: self.rows_per_job]
        with torch.no_grad(), self.trainer.accelerator.autocast():
            for i in range(self.WARM_UP_JOBS):
                self.add(("warm-up", i), rows, job_seed=i)
                self.run(self.check_every)
                job = self.residents.pop()
                self._drop(job)
            for size in self.prefill_sizes if self.prefill_compiled else []:
                for _ in range(self.WARM_UP_CALLS + ((size, self.prompt_part) not in self.prefill_caches)):
                    job = Sequence(("warm-up", size), rows[:size], [0] * size)
                    self._prefill([(job, row) for row in range(size)], size)
                    self._drop(job)
            for width, plan in self.reads.steps:
                step, *inputs = self._step_over(width, plan)
                for _ in range(self.WARM_UP_CALLS + 1):
                    step(*inputs)
        self.steps = self.row_steps = self.kept_tokens = self.prompt_tokens = 0
        self.graphs_after_warm_up = compiled_graphs()
        self.warm_up_graphs = self.graphs_after_warm_up - graphs_before  # (its own: other decoders' are compiled)
        return time.monotonic() - start

    def recompiles(self) -> int:
        return compiled_graphs() - (self.graphs_after_warm_up or 0)
