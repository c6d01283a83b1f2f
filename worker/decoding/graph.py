"""The worker's own decoding step (``--worker_decoding graph``): one compiled function per token.

transformers' ``generate`` runs host-side work around each (compiled) forward: the inputs sliced and the
attention mask and positions concatenated, a float32 copy of the logits, the logits processors run eagerly
(top-p sorts the whole vocabulary), ``torch.multinomial``, and a host sync on the unfinished rows every step.
On a GPU that costs more than the forward itself. Here the whole step is one function, compiled with
``fullgraph=True`` (CUDA graphs on a GPU: one launch per token):

- the forward of every row's newest token over a static KV cache (transformers' ``StaticCache``), the attention
  mask and the positions read from preallocated buffers; q/k/v and gate/up one GEMM each
  (worker/decoding/fused_projections.py). The attention reads only the cache's written prefix, rounded up to a
  bucket of columns (worker/decoding/attention.py): the cache holds ``max_completion_length`` columns for the
  completion, and at long completions reading the columns not yet written (masked out) was most of a step. Each
  bucket is a graph of its own (fixed shapes, so CUDA graphs still apply), ATTENTION_BUCKETS of them, all compiled
  in the warm-up; the host picks the step's bucket from the step's index, which it knows without a sync;
- the logits processing, sampling and behaviour log-prob of worker/decoding/step.py (``next_token``), whose
  sampling draws from the device's generator;
- per row: pad once the row has ended, ended when the token is an EOS; the token and its log-prob written at the
  step's column, the mask and position advanced. The step's index is a tensor: a Python int that changed each
  step would compile a graph per step.

The prefill runs over TRL's left-padded prompts, padded further on the left to the cache's prompt part (one shape,
so one graph), and chooses the first token in the same function; compiled with CUDA graphs on a GPU (run eagerly
it costs about 40 ms a call of launches at the 0.5B shape, a fifth of a 64-token call), eager on a CPU, where it is
compute-bound and compiling it costs start-up time. The host then only launches steps, and asks whether every row
has ended every DONE_CHECK_EVERY steps (one sync each). The result is what
TRL's ``_generate_single_turn`` returns (completion ids cut after the first EOS) with the behaviour log-probs, so
scoring, rewards and the PS do not change.

Shapes are fixed: the rows (``jobs_per_generate`` jobs' rows; a call with fewer is filled up with copies of its
first row) and the cache (the longest prompt seen at start-up rounded up to PROMPT_BUCKET, plus
``max_completion_length``). A longer prompt gets a larger cache and new graphs, counted as recompiles. Weight
syncs copy into the parameters' storage (asyncgrpo/weights), so the graph stays valid across syncs.

What the step does not implement (``OwnStep.unsupported``, worker/decoding/step.py) falls back to compiled
``generate`` (worker/decoding/build.py decides).
"""

from __future__ import annotations

import bisect
import functools
import logging
import time

import torch
from torch.profiler import record_function
from transformers import StaticCache

from worker.behaviour import BehaviourCapture
from worker.decoding import Generation
from worker.decoding.compiled import FixedBatchDecoding
from worker.decoding.compiled_step import compiled_graphs
from worker.decoding.shapes import ATTENTION_BUCKETS, bucketed, column_buckets, static_buffer
from worker.decoding.step import OwnStep, next_token
from worker.in_flight import InFlightWeights

log = logging.getLogger("asyncgrpo.worker")

DONE_CHECK_EVERY = 16  # steps between the host's checks that every row has ended (each is one device sync)


class DecodeState:
    """The step's preallocated buffers (their addresses never change: CUDA graphs read and write them in place)."""

    def __init__(self, rows: int, cache_len: int, max_new: int, device: torch.device):
        buffer = functools.partial(static_buffer, device=device)

        self.cache_len = cache_len
        self.mask = buffer(rows, cache_len)  # the attention mask over the cache (0: left padding, not yet written)
        self.position = buffer(rows)  # each row's position of `last`
        self.last = buffer(rows)  # the token each row feeds to the next forward
        self.ended = buffer(rows, dtype=torch.bool)
        self.step = buffer()  # the column of the next token
        self.prompt_len = buffer()
        self.tokens = buffer(rows, max_new)
        self.logps = buffer(rows, max_new, dtype=torch.float32)
        self.seen: torch.Tensor | None = None  # with a repetition penalty: [rows, vocab + 1], the tokens seen


class GraphDecoding(FixedBatchDecoding, OwnStep):
    """The worker's own decoding loop (see the module's docstring)."""

    mode = "graph"

    # The first call allocates the cache (an eager prefill) and compiles the step, the second compiles the prefill,
    # the third records the prefill's CUDA graph. Then each bucket's step is run BUCKET_WARM_UP_STEPS times.
    WARM_UP_CALLS = 3
    BUCKET_WARM_UP_STEPS = 3

    def __init__(self, trainer, jobs_per_generate: int, prompt_ids: list[list[int]], compile: bool = True,
                 compile_prefill: bool | None = None, compile_mode: str | None = None, fuse: bool = True,
                 attention_buckets: int = ATTENTION_BUCKETS):
        """``compile=False``: the same step run eagerly (for tests; the results are the same, slower).
        ``compile_prefill``: compile the prefill too (default: on CUDA). ``compile_mode``: torch.compile's mode
        (default: ``reduce-overhead``, CUDA graphs, on CUDA). ``fuse``: q/k/v and gate/up as one GEMM each
        (worker/decoding/fused_projections.py). ``attention_buckets``: the step's graphs, each reading a longer
        prefix of the cache (1: every step reads the whole cache)."""
        super().__init__(trainer, jobs_per_generate)
        longest = max((len(ids) for ids in prompt_ids), default=1)
        self.attention_buckets = attention_buckets
        self.cache: StaticCache | None = None
        self.state: DecodeState | None = None
        self.buckets: list[int] = []  # the prefixes of the cache the step's graphs read, in columns
        self.steps_run = 0  # decoding steps after the prefills, over every call (the benchmarks' row utilisation)
        self._set_up_step(trainer, compile, compile_prefill, compile_mode, fuse, step_graphs_of_its_own=True)
        self._allocate(self.rows_per_call, longest)

    def _allocate(self, rows: int, prompt_tokens: int) -> None:
        self.prompt_part = bucketed(prompt_tokens)  # every prefill's width
        cache_len = self.prompt_part + self.max_new
        self.cache = StaticCache(config=self.model.config, max_cache_len=cache_len)
        self.state = DecodeState(rows, cache_len, self.max_new, self.device)
        self.buckets = column_buckets(self.prompt_part, self.max_new, self.attention_buckets)

    def columns_read(self, step: int) -> int:
        """The prefix of the cache step ``step``'s forward reads: its bucket of the columns written once it has
        written its token's (the prompt part, then one column a step)."""
        return self.buckets[bisect.bisect_left(self.buckets, self.prompt_part + step)]

    def warm_up(self, prompt_ids: list[list[int]]) -> float:
        """FixedBatchDecoding's warm-up, then each bucket's step compiled (and its CUDA graph recorded): a call whose
        rows all end early never reaches the later buckets."""
        start = time.monotonic()
        super().warm_up(prompt_ids)
        batch = self.pad_batch(prompt_ids[: self.rows_per_call])
        with torch.no_grad(), self.trainer.accelerator.autocast():
            for columns in self.buckets:
                st = self._prefill(*self._prefill_inputs(batch))
                for _ in range(min(self.BUCKET_WARM_UP_STEPS, self.max_new - 1)):  # (the step's column in range)
                    self._compiled_step(self.cache, st, columns)
        self.graphs_after_warm_up = compiled_graphs()
        return time.monotonic() - start

    # ------------------------------------------------------------------ inside the graph

    def _prefill_step(self, cache: StaticCache, st: DecodeState, ids: torch.Tensor, position: torch.Tensor) -> None:
        out = self.model(input_ids=ids, attention_mask=st.mask, position_ids=position, cache=cache, use_cache=True,
                         logits_to_keep=1, attention_columns=self.prompt_part)
        self._choose(out.logits[:, -1, :].float(), st)

    def _step(self, cache: StaticCache, st: DecodeState, columns: int) -> None:
        """One token per row, attending to the cache's first ``columns`` columns (a Python int: a graph each)."""
        out = self.model(input_ids=st.last[:, None], attention_mask=st.mask, position_ids=st.position[:, None],
                         cache=cache, use_cache=True, attention_columns=columns)
        self._choose(out.logits[:, -1, :].float(), st)

    def _choose(self, logits: torch.Tensor, st: DecodeState) -> None:
        """Picks each row's token from ``logits`` (float32, [rows, vocab], straight from the model), records it and
        its behaviour log-prob at column ``st.step``, and advances the row."""
        token, logp = next_token(logits, self.sampling, self.eos, st.seen, st.step)
        token = torch.where(st.ended, self.pad, token)
        logp = torch.where(st.ended, 0.0, logp)
        column = st.step.view(1)
        st.tokens.index_copy_(1, column, token[:, None])
        st.logps.index_copy_(1, column, logp[:, None])
        st.ended.logical_or_(torch.isin(token, self.eos))
        st.last.copy_(token)
        st.mask.index_fill_(1, (st.prompt_len + st.step).view(1), 1)  # where the next forward writes `token`
        st.position.add_(1)
        if st.seen is not None:
            st.seen.scatter_(1, token[:, None], True)
        st.step.add_(1)

    # ------------------------------------------------------------------ on the host

    def generate_batch(self, prompt_ids: list[list[int]], seed: int,
                       in_flight: InFlightWeights | None = None) -> Generation:
        torch.manual_seed(seed)
        if in_flight is not None:
            in_flight.start()
        completion_ids, tokens, logps = self.decode_batch(
            prompt_ids, before_token=in_flight.before_token if in_flight is not None else None)
        behaviour = BehaviourCapture(self.trainer)
        behaviour.given(tokens, logps)
        return Generation(completion_ids, behaviour, list(in_flight.runs) if in_flight is not None else None)

    def decode_batch(self, prompt_ids: list[list[int]], before_token=None
                     ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """TRL's ``_generate_single_turn`` for ``prompt_ids``: each row's completion ids, cut after its first EOS;
        and, on the CPU, the tokens [rows, steps] and their behaviour log-probs. ``before_token(i)`` is called on
        the host before token i (i >= 1) is sampled (in-flight weight updates, worker/in_flight.py)."""
        ids, mask = self._prefill_inputs(prompt_ids)
        with record_function("decode.prefill"):  # (the names bench/generation_bench.py --profile reports)
            st = self._prefill(ids, mask)
        with record_function("decode.steps"):
            for step in range(1, self.max_new):
                if before_token is not None:
                    before_token(step)
                self._compiled_step(self.cache, st, self.columns_read(step))
                self.steps_run += 1
                if step % DONE_CHECK_EVERY == 0 and bool(st.ended.all()):
                    break
        with record_function("decode.to_host"):
            tokens, logps = st.tokens.cpu(), st.logps.cpu()
        completion_ids = []
        for row in tokens.tolist():  # (on the host: self.eos is on the device)
            end = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            completion_ids.append(row if end is None else row[:end + 1])
        return completion_ids, tokens, logps

    def _prefill_inputs(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill's ids and attention mask on the device: left-padded as TRL pads them, then further to the
        cache's prompt part (the prefill's one shape)."""
        width = self._padded_prompts(prompt_ids)[0].size(1)
        if len(prompt_ids) != self.state.tokens.size(0) or width > self.prompt_part:
            self._allocate(len(prompt_ids), width)  # new shapes: new graphs
        ids, mask = self._padded_prompts(prompt_ids, self.prompt_part)
        return ids.to(self.device), mask.to(self.device)

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> DecodeState:
        st, (rows, width) = self.state, ids.shape
        position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate's positions
        self.cache.reset()
        st.mask.zero_()
        st.mask[:, :width] = mask
        st.tokens.fill_(self.pad)
        st.logps.zero_()
        st.ended.zero_()
        st.step.zero_()
        st.prompt_len.fill_(width)
        if self.sampling.repetition_penalty is not None:
            if st.seen is None:
                st.seen = static_buffer(rows, self.vocab + 1, dtype=torch.bool, device=self.device)
            st.seen.zero_()
            # The prompt's tokens, not its padding (transformers' prompt_ignore_length): padding goes to the extra
            # column.
            st.seen.scatter_(1, ids.masked_fill(mask == 0, self.vocab).clamp(max=self.vocab), True)
        st.position.copy_(position[:, -1])
        # transformers allocates a static cache's tensors at their first update, and marks their addresses static
        # (what CUDA graphs need to write into them in place) only outside a compiled region: so the first prefill
        # into each cache runs eagerly.
        allocated = all(getattr(layer, "is_initialized", True) for layer in self.cache.layers)
        (self._compiled_prefill if allocated else self._prefill_step)(self.cache, st, ids, position)
        return st
