"""Continuous batching (``--worker_decoding continuous``): a worker's decoding as an engine that keeps its rows
busy while jobs wait.

A fixed batch lasts as long as its longest row, and completion lengths have a long tail: most of its row-steps
decode rows that already ended. Here the batch is ``--decoding_slots`` row slots. A job's G rows wait in line for
slots and join one by one, each into the first free slot; each slot decodes on its own until its
row ends (EOS or the length cap), when its tokens are copied out and the slot takes the next waiting row at once. A
job whose rows have all ended leaves, to be scored while the others decode.

Shapes stay fixed, so the step and the prefills compile once (CUDA graphs on a GPU), as the graph decoder's
(worker/decoding/graph.py; the logits processing, sampling and behaviour log-prob of worker/decoding/step.py); or the
same functions run uncompiled (``--worker_decoding auto`` on a CPU: worker/decoding/build.py):

- each slot has its own columns of the KV cache, as a fixed batch's row (worker/decoding/slot_cache.py): a row's
  prompt ends at the prompt part's end and its i-th token goes after it, whenever it joined; attention reads each
  slot's own columns through its row of a mask. Ranges of slots read their own number of columns, rows moving to
  a range that reads more as they grow (one graph), or every slot reads the same bucket (``SlotReads``; one graph,
  its number of columns a variable); with few rows in the slots (on a CPU), a step computes only the first half,
  quarter, eighth or sixteenth of the slots, the rows moving into them (the buckets' graph, its number of rows a
  variable);
- a joining row is prefilled (compiled on a GPU: two shapes, a graph each) into its slot's prompt columns, once for
  the rows of its group (the others copy its columns), or, with the prefill eager (a CPU's), a short prompt is fed
  through its slot's next steps a token a step;
- a row's random draws depend on its job's seed, its row and its token's index only (``seeded_exponentials``, a
  counter-based hash): a job samples the same tokens whichever slots, whichever steps, and whichever other jobs it
  decodes beside.

Every ``check_every`` steps (CHECK_EVERY) the host reads which slots ended (one device sync), frees them, hands
finished jobs out, and looks for newer weights: they are synced in place between steps, and each row records the
versions that sampled its tokens (``runs``, as worker/in_flight.py defines them, one list a row: a job's rows
join at different steps; a job's weights_version is its oldest token's).

The engine is cut by what each part does: a job and its rows (worker/decoding/sequence.py ``Sequence``); the
scheduler, which decides which row decodes in which slot and what happens next and touches no tensor
(worker/decoding/scheduler.py); the runner, which carries that out on the slots' cache and runs the compiled steps
(worker/decoding/slot_runner.py); the cache, the slots' state and the plans of reads (worker/decoding/slot_cache.py);
and here the engine's loop: ``add`` a job, ``run`` steps (admit, schedule, run), ``collect`` what ended.

The worker's loop drives it through worker/generation.py's EngineGeneration (jobs joining, scoring on a thread of
its own while the slots decode, publishing).
"""

from __future__ import annotations

import time

import torch

from worker.behaviour import BehaviourCapture
from worker.decoding import Generation
from worker.decoding.compiled_step import compiled_graphs
from worker.decoding.scheduler import Scheduler
from worker.decoding.seeded_draws import row_seed
from worker.decoding.sequence import FinishedJob, Sequence
from worker.decoding.slot_runner import SlotRunner
from worker.decoding.step import OwnStep

# Decoding steps between the host's looks at which rows ended: on a GPU each look is a device sync (the queue of
# launched steps drains). On a CPU the engine's part of a look costs a fraction of a millisecond against a step's 15-25
# ms at the `larger` shape (profiled: the ended rows, the next plan, the joining rows' feeds), and each step a row's
# slot stays taken after the row ended keeps nothing: looking every step raised the utilisation over a 24-job
# long-tail stream from 0.90 to 0.92. Samples/s of the uncompiled engine (`auto`'s) stayed the same within the
# machine's noise; through the worker's loop, which also looks for newer weights at each look, a job's generation took
# 12% less time. The compiled engine lost 3-5% with prompts of 128-256 tokens: those are prefilled at the look that
# admits their rows, 4-6 ms a call whatever its rows, so more looks make more and smaller calls (docs/performance.md,
# "A look every step").
CHECK_EVERY = {"cuda": 8, "cpu": 1}


class ContinuousDecoding:
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
        self.runner = runner = SlotRunner(trainer, slots, compile, compile_prefill, compile_mode, fuse)
        runner.allocate(max((len(ids) for ids in prompt_ids), default=1))
        self.scheduler = Scheduler(slots, self.rows_per_job, runner.reads, runner.fed_prompt_tokens,
                                   runner.prefill_sizes if runner.pads_prefills else None, share_prompts)
        self.check_every = CHECK_EVERY.get(runner.device.type, 8)
        self.kept_tokens = 0  # tokens of the rows that ended (the rest of the row-steps decoded nothing kept)
        self.graphs_after_warm_up: int | None = None
        self.warm_up_graphs = 0  # graphs its warm-up compiled

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

    def reallocate(self, prompt_tokens: int) -> None:
        """Caches for prompts of up to ``prompt_tokens`` tokens (the engine is empty): new shapes, new graphs."""
        assert self.empty(), "reallocating with jobs in the slots"
        self.runner.allocate(prompt_tokens)
        self.scheduler.reallocated(self.runner.reads)

    # ------------------------------------------------------------------ what the worker's loop asks

    @property
    def version(self) -> int | None:
        """The weights the model holds."""
        return self.scheduler.version

    @version.setter
    def version(self, version: int | None) -> None:
        self.scheduler.version = version

    @property
    def steps(self) -> int:
        return self.scheduler.steps

    @property
    def prompt_part(self) -> int:
        return self.runner.prompt_part

    @property
    def reads(self):
        return self.runner.reads

    @property
    def row_steps(self) -> int:
        return self.runner.row_steps

    @property
    def prompt_tokens(self) -> int:
        return self.runner.prompt_tokens

    def fits(self, prompt_ids: list[list[int]]) -> bool:
        return max(len(ids) for ids in prompt_ids) <= self.runner.prompt_part

    def wants_a_job(self) -> bool:
        return self.scheduler.wants_a_job()

    def empty(self) -> bool:
        return self.scheduler.empty()

    # ------------------------------------------------------------------ the loop: add, run, collect

    def add(self, key, prompt_ids: list[list[int]], job_seed: int) -> None:
        """A job's rows wait in line for slots; those that find one join at once (the caller checked ``fits``)."""
        rows = len(prompt_ids)
        if rows != self.rows_per_job:
            raise ValueError(f"a job of {rows} rows for an engine of {self.rows_per_job}-row jobs")
        self.scheduler.add(Sequence(key, [list(p) for p in prompt_ids], [row_seed(job_seed, r) for r in range(rows)],
                                    added_step=self.scheduler.steps))
        self._admit()

    def run(self, steps: int) -> None:
        """``steps`` decoding steps over the slots that hold rows, after the waiting rows that find a free slot
        join."""
        self._admit()
        self.runner.run(self.scheduler.schedule(steps), steps)

    def _admit(self) -> None:
        for joining in self.scheduler.admit():
            self.runner.join(joining)

    def collect(self) -> list[FinishedJob]:
        """Frees the slots of the rows that have ended (their tokens copied out) and returns the jobs whose rows have
        all ended. One device sync, and a copy when rows ended."""
        if self.scheduler.empty():
            return []
        ended = self.runner.ended_rows()
        self.kept_tokens += sum(len(tokens) for tokens, _ in ended.values())
        return [job.finished(self.runner.pad, self.scheduler.steps) for job in self.scheduler.ended(ended)]

    def weights_changed(self, version: int) -> None:
        """The model now holds ``version``: each decoding row's next token is sampled by it (a waiting row's first)."""
        self.scheduler.weights_changed(version)

    def generate(self, prompt_ids: list[list[int]], seed: int, in_flight: None = None) -> Generation:
        """The engine as one decoder call (worker/decoding's interface: tests and benchmarks): the rows as jobs of
        ``rows_per_job`` rows, job i seeded from ``seed`` and i, their rows joining as slots free up, until every row
        has ended. The worker's continuous loop drives the engine itself, and syncs newer weights between
        its steps itself: ``in_flight`` is not taken."""
        if in_flight is not None:
            raise ValueError("the engine syncs newer weights between its steps itself (worker/generation.py)")
        if len(prompt_ids) % self.rows_per_job or not self.empty():
            raise ValueError(f"{len(prompt_ids)} rows for an engine of {self.rows_per_job}-row jobs, "
                             f"{len(self.scheduler.residents)} jobs in it")
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
        pad = self.runner.pad
        tokens = torch.cat([torch.nn.functional.pad(job.tokens, (0, width - job.tokens.size(1)), value=pad)
                            for job in ordered])
        logps = torch.cat([torch.nn.functional.pad(job.logps, (0, width - job.logps.size(1))) for job in ordered])
        behaviour = BehaviourCapture(self.trainer)
        behaviour.given(tokens, logps)
        return Generation([ids for job in ordered for ids in job.completion_ids], behaviour)

    # ------------------------------------------------------------------ what it counts

    def decoded_tokens(self) -> int:
        """Tokens sampled so far, by the rows that ended and those still decoding (one device sync)."""
        return self.kept_tokens + self.runner.decoding_tokens()

    def utilisation(self) -> float:
        """Row-steps that produced a kept token over row-steps computed (so far)."""
        return self.kept_tokens / self.runner.row_steps if self.runner.row_steps else 0.0

    def warm_up(self, prompt_ids: list[list[int]]) -> float:
        """Compiles the step and every prefill size: WARM_UP_JOBS jobs of ``prompt_ids``' first rows one after the
        other, each dropped after a look's steps (decoding them to their ends cost a stream's tail: 9.6 s of a
        33 s warm warm-up, profiled, at a cap of 512 on a CPU), then, with the prefill compiled, WARM_UP_CALLS
        prefills of each other size, their rows dropped, and WARM_UP_CALLS + 1 of each step (``SlotReads.steps``,
        with no row in the slots). Run eagerly, one job's prefill and steps: nothing to compile, but a model the
        engine cannot run fails here, where the worker falls back, not on every job. Returns the seconds it took."""
        start, graphs_before = time.monotonic(), compiled_graphs()
        runner = self.runner
        rows = (prompt_ids * self.rows_per_job)[: self.rows_per_job]
        with torch.no_grad(), self.trainer.accelerator.autocast():
            for i in range(self.WARM_UP_JOBS if runner.compiles else 1):
                self.add(("warm-up", i), rows, job_seed=i)
                self.run(self.check_every)
                runner.free(self.scheduler.drop(self.scheduler.residents[-1]))
            for size in runner.prefill_sizes if runner.prefill_compiled else []:
                for _ in range(self.WARM_UP_CALLS + ((size, runner.prompt_part) not in runner.prefill_caches)):
                    job = Sequence(("warm-up", size), rows[:size], [0] * size)
                    runner.warm_up_prefill([(job, row) for row in range(size)])
            for width, reads in runner.reads.steps if runner.compiles else []:
                step, *inputs = runner.step_over(width, reads)
                for _ in range(self.WARM_UP_CALLS + 1):
                    step(*inputs)
        self.scheduler.steps = runner.row_steps = runner.prompt_tokens = self.kept_tokens = 0
        self.graphs_after_warm_up = compiled_graphs()
        self.warm_up_graphs = self.graphs_after_warm_up - graphs_before  # (its own: other decoders' are compiled)
        return time.monotonic() - start

    def recompiles(self) -> int:
        return compiled_graphs() - (self.graphs_after_warm_up or 0)

    def undo(self) -> None:
        """Back to transformers' attention (compilation failed)."""
        self.runner.undo()
