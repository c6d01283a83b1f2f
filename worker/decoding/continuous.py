"""Continuous batching (``--worker_decoding continuous``): a worker's decoding as an engine that keeps its rows
busy while jobs wait.

A fixed batch lasts as long as its longest row, and completion lengths have a long tail: most of its row-steps
decode rows that already ended. Here the batch is ``--decoding_slots`` row slots. A job's G rows join together,
each into a free slot, through a prefill; each slot decodes on its own until its row ends (EOS or the length cap),
when its tokens are copied out and the slot is free again; the next job joins as soon as G slots are free (any G),
and a job whose rows have all ended leaves at once, to be scored while the others decode. What a slot decodes
while it waits for G - 1 others to free up is the waste left, about G / 2 of the slots.

Shapes stay fixed, so the step and the prefill compile once (CUDA graphs on a GPU), as the graph decoder's
(worker/decoding/graph.py, whose logits processing, sampling and behaviour log-prob this shares):

- the KV cache is one ring of ``prompt part + max_completion_length`` columns for every slot (``SlotCache``).
  Every step writes every slot's newest key and value at the same column, the next one round the ring; a joining
  row's prompt is copied into the columns before it. A row lives for at most prompt part + max_completion_length
  columns, so it never overwrites its own; attention reads each slot's own columns through its row of a mask (a
  key's column does not matter to attention: RoPE placed it by the row's own position ids);
- the prefill runs one job's rows (prompts padded on the left to the prompt part, as TRL pads them) over a cache
  of their own, then writes their keys and values into their slots' ring columns and chooses their first tokens;
- a row's random draws depend on its job's seed, its row and its token's index only (``seeded_exponentials``, a
  counter-based hash): a job samples the same tokens whichever slots, and whichever other jobs, it decodes beside.

Every ``check_every`` steps (CHECK_EVERY) the host reads which slots ended (one device sync), frees them, hands
finished jobs out, and looks for newer weights: they are synced in place between steps, and each job records the
versions that sampled its tokens (``runs``, as worker/in_flight.py defines them; a job's weights_version is its
oldest token's).

The worker loop around it (claims, scoring on a thread of its own while the slots decode, publishing) is
worker/continuous_loop.py.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch
from transformers import StaticCache
from trl.trainer.utils import pad

from worker.behaviour import BehaviourCapture
from worker.decoding import Generation
from worker.decoding.compiled import bucketed
from worker.decoding.compiled_step import compiled_graphs
from worker.decoding.graph import GraphDecoding, OwnStep, log_prob_at, sample, static_buffer

# Decoding steps between the host's looks at which rows ended: on a GPU each look is a device sync (the queue of
# launched steps drains); on a CPU every op is synchronous already, and a row that ended waits for no look.
CHECK_EVERY = {"cuda": 8, "cpu": 1}

# splitmix64's constants, as signed 64-bit integers (torch has no uint64 arithmetic)
GOLDEN = 0x9E3779B97F4A7C15 - 2**64
MIX1 = 0xBF58476D1CE4E5B9 - 2**64
MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_exponentials(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws [rows, vocab] that depend only on each row's seed, its counter (the token's index) and the
    vocabulary position: splitmix64 (Steele et al.) of ``seed + (counter * vocab + position) * golden``, its top 23
    bits a uniform in (0, 1). Integer products wrap, as the hash wants."""
    x = seeds[:, None] + (counters[:, None] * vocab + torch.arange(vocab, device=seeds.device)[None, :]) * GOLDEN
    x = (x ^ _shift_right(x, 30)) * MIX1
    x = (x ^ _shift_right(x, 27)) * MIX2
    return -torch.log(unit_interval(x ^ _shift_right(x, 31)))


def unit_interval(x: torch.Tensor) -> torch.Tensor:
    """The top 23 bits of int64 ``x`` as a float32 strictly inside (0, 1): (k + 0.5) / 2**23 is exact in float32,
    so no draw rounds to 1 (with 24 bits the largest does, and its Exp(1) draw of 0 wins every race)."""
    return (_shift_right(x, 41).to(torch.float32) + 0.5) / 2**23


def row_seed(job_seed: int, row: int) -> int:
    """Row ``row`` of a job's seed for ``seeded_exponentials`` (rows must differ: a group of equal samples teaches
    nothing), as a signed 64-bit integer."""
    z = (job_seed * 0x9E3779B97F4A7C15 + row * 0xD1B54A32D192ED03 + 1) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return z - 2**64 if z >= 2**63 else z


class SlotCache:
    """Keys and values [slots, heads, columns, dim] per layer, a ring: every step writes every slot at ``column``.
    What transformers' attention layers ask of a cache here is ``update``."""

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], column: torch.Tensor):
        self.keys, self.values, self.column = keys, values, column

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.column, key_states)
        self.values[layer_idx].index_copy_(2, self.column, value_states)
        return self.keys[layer_idx], self.values[layer_idx]


@dataclass
class FinishedJob:
    """A job whose rows have all ended: TRL's ``_generate_single_turn`` output for its prompts (completion ids cut
    after the first EOS), the tokens and behaviour log-probs [rows, tokens] on the CPU, and the runs of versions
    that sampled them."""

    key: object
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    tokens: torch.Tensor
    logps: torch.Tensor
    runs: list[tuple[int, int]]
    decode_s: float


@dataclass
class _Resident:
    """A job in the engine: its rows' slots (row i in ``slots[i]`` until it ends) and the rows already ended,
    copied out: {row: (tokens, log-probs)}."""

    key: object
    prompt_ids: list[list[int]]
    slots: list[int]
    joined_step: int
    runs: list[tuple[int, int]]
    ended: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    joined_at: float = field(default_factory=time.monotonic)


class SlotState:
    """The engine's device buffers, allocated once (CUDA graphs read and write them in place)."""

    def __init__(self, slots: int, columns: int, max_new: int, device: torch.device):
        buffer = functools.partial(static_buffer, device=device)

        self.mask = buffer(slots, columns, dtype=torch.bool)  # the ring columns each slot attends to
        self.column = buffer(1)  # the ring column the next step writes
        self.last = buffer(slots)  # the token each slot feeds to the next step
        self.position = buffer(slots)  # its position (RoPE)
        self.count = buffer(slots)  # tokens the slot's row has sampled (its next token's index)
        self.ended = buffer(slots, dtype=torch.bool)
        self.active = buffer(slots, dtype=torch.bool)  # holds a row of a job in the engine
        self.seed = buffer(slots)
        self.tokens = buffer(slots, max_new + 1)  # the last column takes the writes of rows that ended
        self.logps = buffer(slots, max_new + 1, dtype=torch.float32)
        self.seen: torch.Tensor | None = None  # with a repetition penalty: [slots, vocab + 1]


class ContinuousDecoding(OwnStep):
    """The engine (see the module's docstring). ``add`` a job's rows, ``run`` steps, ``collect`` finished jobs."""

    mode = "continuous"

    WARM_UP_JOBS = 3  # the first prefill allocates the caches eagerly, the second compiles, the third records

    def __init__(self, trainer, slots: int, prompt_ids: list[list[int]], compile: bool = True,
                 compile_prefill: bool | None = None, compile_mode: str | None = None, fuse: bool = True):
        self.trainer = trainer
        self.rows_per_job = trainer.args.generation_batch_size
        if slots < self.rows_per_job:
            raise ValueError(f"--decoding_slots {slots} cannot hold one job's {self.rows_per_job} rows")
        self.slots = self.rows_per_call = slots
        self._set_up_step(trainer, compile, compile_prefill, compile_mode, fuse)
        self.check_every = CHECK_EVERY.get(self.device.type, 8)
        self.residents: list[_Resident] = []
        self.owners: dict[int, tuple[_Resident, int]] = {}  # slot: the job and row it decodes
        self.free: list[int] = list(range(slots))
        self.steps = 0  # decoding steps run, over every slot
        self.row_steps = 0  # rows computed: slots x steps, plus each prefill's rows
        self.kept_tokens = 0  # tokens of the rows that ended (the rest of the row-steps decoded nothing kept)
        self.version: int | None = None  # the weights the model holds
        self.graphs_after_warm_up: int | None = None
        self._allocate(max((len(ids) for ids in prompt_ids), default=1))

    @staticmethod
    def unsupported(trainer) -> str | None:
        """Why the engine cannot generate for this trainer (the worker then decodes as ``graph`` would), or None."""
        why = GraphDecoding.unsupported(trainer)
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
        self.free = list(range(self.slots))

    def _allocate(self, prompt_tokens: int) -> None:
        self.prompt_part = bucketed(prompt_tokens)
        self.columns = self.prompt_part + self.max_new
        self.state = SlotState(self.slots, self.columns, self.max_new, self.device)
        self.prefill_cache = StaticCache(config=self.model.config, max_cache_len=self.prompt_part)
        self.cache: SlotCache | None = None  # allocated at the first prefill, with the dtype keys come in

    def fits(self, prompt_ids: list[list[int]]) -> bool:
        return max(len(ids) for ids in prompt_ids) <= self.prompt_part

    def free_slots(self) -> int:
        return len(self.free)

    def empty(self) -> bool:
        return not self.residents

    # ------------------------------------------------------------------ inside the graphs

    def _prefill_step(self, cache: StaticCache, st: SlotState, ids, mask, position, slots, seeds) -> None:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position, cache=cache, use_cache=True,
                         logits_to_keep=1)
        # The prompt goes into the ring columns just before the one the next step writes.
        columns = (st.column + torch.arange(self.prompt_part, device=ids.device) - self.prompt_part) % self.columns
        for small, keys, values in zip(cache.layers, self.cache.keys, self.cache.values, strict=True):
            keys.transpose(1, 2).index_put_((slots[:, None], columns[None, :]), small.keys.transpose(1, 2))
            values.transpose(1, 2).index_put_((slots[:, None], columns[None, :]), small.values.transpose(1, 2))
        st.mask.index_fill_(0, slots, False)
        st.mask.index_put_((slots[:, None], columns[None, :]), mask.bool())
        st.seed.index_copy_(0, slots, seeds)
        st.count.index_fill_(0, slots, 0)
        st.ended.index_fill_(0, slots, False)
        st.active.index_fill_(0, slots, True)
        st.tokens.index_fill_(0, slots, self.pad)
        st.logps.index_fill_(0, slots, 0.0)
        if st.seen is not None:
            st.seen.index_fill_(0, slots, False)
            # The prompt's tokens, not its padding (transformers' prompt_ignore_length): padding to the extra column.
            prompt_tokens = ids.masked_fill(mask == 0, self.vocab)
            st.seen.index_put_((slots[:, None], prompt_tokens), torch.ones_like(prompt_tokens, dtype=torch.bool))
        st.position.index_copy_(0, slots, position[:, -1] + 1)  # the first token's, fed to the next step
        self._choose(out.logits[:, -1, :].float(), st, slots)

    def _step(self, cache: SlotCache, st: SlotState) -> None:
        st.mask.index_fill_(1, st.column, True)  # every slot attends to the column this step writes
        out = self.model(input_ids=st.last[:, None], attention_mask=st.mask[:, None, None, :],
                         position_ids=st.position[:, None], cache=cache, use_cache=True)
        self._choose(out.logits[:, -1, :].float(), st, None)
        st.column.copy_((st.column + 1) % self.columns)

    def _choose(self, logits: torch.Tensor, st: SlotState, slots: torch.Tensor | None) -> None:
        """Processes the logits of ``slots`` (all when None), picks each row's token with its own draws, records it
        and its behaviour log-prob at the row's count, and advances the row."""
        def of(t):
            return t if slots is None else t.index_select(0, slots)

        s = self.sampling
        count, ended = of(st.count), of(st.ended)
        live = of(st.active) & ~ended
        scores = logits
        if s.repetition_penalty is not None:
            penalised = torch.where(scores < 0, scores * s.repetition_penalty, scores / s.repetition_penalty)
            scores = torch.where(of(st.seen)[:, :scores.size(-1)], penalised, scores)
        if s.min_new_tokens:
            is_eos = torch.isin(torch.arange(scores.size(-1), device=scores.device), self.eos)
            scores = torch.where(is_eos & (count < s.min_new_tokens)[:, None], -math.inf, scores)
        noise = seeded_exponentials(of(st.seed), count, scores.size(-1)) if s.do_sample else None
        token = sample(scores, s, noise)
        logp = log_prob_at(logits / s.temperature, token)
        token = torch.where(live, token, self.pad)
        logp = torch.where(live, logp, 0.0)
        count_after = count + live.long()
        ended_after = ended | (live & (torch.isin(token, self.eos) | (count_after >= self.max_new)))
        rows = torch.arange(logits.size(0), device=logits.device) if slots is None else slots
        where = (rows, count.clamp(max=self.max_new))  # a row that ended writes into the spare last column
        st.tokens.index_put_(where, token)
        st.logps.index_put_(where, logp)
        if st.seen is not None:
            st.seen.index_put_((rows, token), torch.ones_like(token, dtype=torch.bool))
        if slots is None:
            st.count.copy_(count_after)
            st.ended.copy_(ended_after)
            st.last.copy_(token)
            st.position.add_(1)
        else:
            st.count.index_copy_(0, slots, count_after)
            st.ended.index_copy_(0, slots, ended_after)
            st.last.index_copy_(0, slots, token)

    # ------------------------------------------------------------------ on the host

    def add(self, key, prompt_ids: list[list[int]], job_seed: int) -> None:
        """A job's rows join: prefilled into free slots (the caller checked ``fits`` and ``free_slots``)."""
        rows = len(prompt_ids)
        if rows != self.rows_per_job or rows > len(self.free):
            raise ValueError(f"a job of {rows} rows for {len(self.free)} free slots of {self.rows_per_job}-row jobs")
        slots, self.free = self.free[:rows], self.free[rows:]
        ids = pad([torch.tensor(p) for p in prompt_ids], padding_value=self.pad, padding_side="left",
                  pad_to_multiple_of=self.trainer.pad_to_multiple_of)
        mask = pad([torch.ones(len(p), dtype=torch.long) for p in prompt_ids], padding_value=0, padding_side="left",
                   pad_to_multiple_of=self.trainer.pad_to_multiple_of)
        ids = torch.nn.functional.pad(ids, (self.prompt_part - ids.size(1), 0), value=self.pad)
        mask = torch.nn.functional.pad(mask, (self.prompt_part - mask.size(1), 0), value=0)
        position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate's positions
        seeds = torch.tensor([row_seed(job_seed, r) for r in range(rows)], dtype=torch.long)
        st = self.state
        if self.sampling.repetition_penalty is not None and st.seen is None:
            st.seen = static_buffer(self.slots, self.vocab + 1, dtype=torch.bool, device=self.device)
        self.prefill_cache.reset()
        args = [t.to(self.device) for t in (ids, mask, position, torch.tensor(slots), seeds)]
        # transformers allocates a static cache's tensors at their first write and marks their addresses static
        # only outside a compiled region: the first prefill runs eagerly, and allocates the ring like them.
        if self.cache is None:
            self._prefill_step_allocating(st, *args)
        else:
            self._compiled_prefill(self.prefill_cache, st, *args)
        self.row_steps += rows
        job = _Resident(key, [list(p) for p in prompt_ids], slots, self.steps, [(0, self.version)])
        self.residents.append(job)
        self.owners.update((slot, (job, row)) for row, slot in enumerate(slots))

    def _prefill_step_allocating(self, st: SlotState, ids, mask, position, *args) -> None:
        # A forward that allocates the prefill's cache and shows the keys' dtype and heads as the model makes them.
        self.model(input_ids=ids, attention_mask=mask, position_ids=position, cache=self.prefill_cache,
                   use_cache=True, logits_to_keep=1)
        self.prefill_cache.reset()
        keys, values = [], []
        for layer in self.prefill_cache.layers:
            for kind, into in ((layer.keys, keys), (layer.values, values)):
                into.append(static_buffer(self.slots, kind.size(1), self.columns, kind.size(3), dtype=kind.dtype,
                                          device=self.device))
        self.cache = SlotCache(keys, values, st.column)
        self._prefill_step(self.prefill_cache, st, ids, mask, position, *args)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self._compiled_step(self.cache, self.state)
        self.steps += steps
        self.row_steps += steps * self.slots

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
            self.free.extend(ended_slots)
            for i, slot in enumerate(ended_slots):
                job, row = self.owners.pop(slot)
                job.ended[row] = (tokens[i, :counts[i]], logps[i, :counts[i]])
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
            runs = [(first, version) for first, version in job.runs if first < max(width, 1)]
            finished.append(FinishedJob(job.key, job.prompt_ids, [t.tolist() for t, _ in rows], tokens, logps, runs,
                                        time.monotonic() - job.joined_at))
        return finished

    def generate(self, prompt_ids: list[list[int]], seed: int, in_flight: None = None) -> Generation:
        """The engine as one decoder call (worker/decoding's interface: tests and benchmarks): the rows as jobs of
        ``rows_per_job`` rows, job i seeded from ``seed`` and i, each joining as soon as its slots are free, until
        every row has ended. The worker's continuous loop drives the engine itself, and syncs newer weights between
        its steps itself: ``in_flight`` is not taken."""
        if in_flight is not None:
            raise ValueError("the engine syncs newer weights between its steps itself (worker/continuous_loop.py)")
        if len(prompt_ids) % self.rows_per_job or not self.empty():
            raise ValueError(f"{len(prompt_ids)} rows for an engine of {self.rows_per_job}-row jobs, "
                             f"{len(self.residents)} jobs in it")
        if not self.fits(prompt_ids):
            self.reallocate(max(len(ids) for ids in prompt_ids))
        jobs = [prompt_ids[i:i + self.rows_per_job] for i in range(0, len(prompt_ids), self.rows_per_job)]
        waiting, finished = list(enumerate(jobs)), {}
        while waiting or not self.empty():
            while waiting and self.free_slots() >= self.rows_per_job:
                key, rows = waiting.pop(0)
                self.add(key, rows, seed if key == 0 else row_seed(seed, -key))
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
        """The model now holds ``version``: each job's next token is sampled by it."""
        self.version = version
        for job in self.residents:
            first = self.steps - job.joined_step + 1  # the job's next token's index (its first came with its prefill)
            if job.runs[-1][0] == first:
                job.runs[-1] = (first, version)
            else:
                job.runs.append((first, version))

    def utilisation(self) -> float:
        """Row-steps that produced a kept token over row-steps computed (so far)."""
        return self.kept_tokens / self.row_steps if self.row_steps else 0.0

    def warm_up(self, prompt_ids: list[list[int]]) -> float:
        """Compiles the prefill and the step by generating WARM_UP_JOBS jobs of ``prompt_ids``' first rows one after
        the other; returns the seconds it took."""
        start = time.monotonic()
        rows = (prompt_ids * self.rows_per_job)[: self.rows_per_job]
        with torch.no_grad(), self.trainer.accelerator.autocast():
            for i in range(self.WARM_UP_JOBS):
                self.add(("warm-up", i), rows, job_seed=i)
                while not self.collect():
                    self.run(self.check_every)
        self.steps = self.row_steps = self.kept_tokens = 0
        self.graphs_after_warm_up = compiled_graphs()
        return time.monotonic() - start

    def recompiles(self) -> int:
        return compiled_graphs() - (self.graphs_after_warm_up or 0)
