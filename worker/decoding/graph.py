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
- the logits processing TRL's generation config asks for, in transformers' order: repetition penalty,
  ``min_new_tokens``, temperature, top-k, top-p, min-p (top-p and min-p on the top-k survivors when top-k is set:
  no sort of the whole vocabulary). Tokens tied with the k-th are cut, which transformers keeps;
- sampling without a host sync: the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` drawn from the device's
  generator, which picks token i with probability ``p_i / sum(p)`` as ``torch.multinomial`` does; greedy
  (``do_sample=False``) takes the argmax. Without top-k and top-p the race runs in log space over chunks of the
  vocabulary (``in_chunks``);
- the chosen token's behaviour log-prob with the definition worker/behaviour.py captures (TRL's recomputation):
  ``log_softmax(logits / temperature)`` at the token, from the logits before any processing;
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

What the step does not implement (``GraphDecoding.unsupported``) falls back to compiled ``generate``
(worker/decoding/build.py decides).
"""

from __future__ import annotations

import bisect
import functools
import inspect
import logging
import math
import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function
from transformers import GenerationConfig, StaticCache
from trl.trainer.utils import pad

from worker.behaviour import BehaviourCapture
from worker.decoding import Generation
from worker.decoding.attention import ATTENTION_BUCKETS, PACKED_SDPA, column_buckets
from worker.decoding.compiled import FixedBatchDecoding, bucketed
from worker.decoding.compiled_step import compiled_graphs, generating_model
from worker.decoding.fused_projections import fuse_projections
from worker.in_flight import InFlightWeights
from worker.trl_seam import GenerationPath, generation_path

log = logging.getLogger("asyncgrpo.worker")

DONE_CHECK_EVERY = 16  # steps between the host's checks that every row has ended (each is one device sync)
# GenerationConfig fields the step implements, or that only say how generate runs (cache, compilation). Any other
# field set differently from transformers' default (beam search, no_repeat_ngram_size, suppress_tokens, a
# watermark...) falls back to compiled generate.
IMPLEMENTED = {"max_new_tokens", "do_sample", "pad_token_id", "bos_token_id", "eos_token_id", "temperature", "top_k",
               "top_p", "min_p", "repetition_penalty", "min_new_tokens", "cache_implementation", "max_cache_len",
               "disable_compile", "compile_config", "transformers_version", "_from_model_config"}
VOCAB_CHUNKS = 64  # pieces of the vocabulary reduced side by side when sampling (see in_chunks)
TINY = 1e-20  # floor of the race's exponential noise: Exp(1) draws 0 once in 2**24, and p / 0 is inf (or NaN)


@dataclass(frozen=True)
class Sampling:
    """TRL's sampling settings as transformers applies them (each None or neutral when off)."""

    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float | None
    min_new_tokens: int

    @classmethod
    def of(cls, gen: GenerationConfig) -> Sampling:
        def active(value, neutral):
            return None if value is None or value == neutral else value

        return cls(do_sample=bool(gen.do_sample), temperature=float(gen.temperature or 1.0),
                   top_k=active(gen.top_k, 0), top_p=active(gen.top_p, 1.0), min_p=active(gen.min_p, 0.0),
                   repetition_penalty=active(gen.repetition_penalty, 1.0), min_new_tokens=gen.min_new_tokens or 0)


def sample(scores: torch.Tensor, s: Sampling, noise: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from ``scores`` (float32 [rows, vocab], already penalised) as transformers' warpers and
    ``torch.multinomial`` would draw it, without a host sync. ``noise``: the Exp(1) draws [rows, vocab] the tokens
    race with (default: drawn from the device's generator)."""
    if s.top_k is None and s.top_p is None:
        return sample_whole_vocabulary(scores, s, noise)
    if s.temperature != 1.0:
        scores = scores / s.temperature
    indices = None  # positions in the vocabulary of the columns of `scores`, when they are a subset or reordered
    if s.top_k is not None:
        scores, indices = torch.topk(scores, min(s.top_k, scores.size(-1)), dim=-1)  # sorted, largest first
    elif s.top_p is not None:
        scores, indices = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(scores, dim=-1)
    if s.top_p is not None:
        # transformers drops a token when the probabilities up to it, counted from the least likely, are at most
        # 1 - top_p: counted from the most likely, when the mass before it is at least top_p.
        probs = torch.where(probs.cumsum(dim=-1) - probs < s.top_p, probs, 0.0)
    if s.min_p is not None:
        probs = torch.where(probs >= s.min_p * probs.amax(dim=-1, keepdim=True), probs, 0.0)
    if noise is None:
        noise = torch.empty_like(probs).exponential_().clamp_min_(TINY)
    elif indices is not None:
        noise = noise.gather(1, indices)
    choice = (probs / noise).argmax(dim=-1)
    return choice if indices is None else indices.gather(1, choice[:, None])[:, 0]


def in_chunks(x: torch.Tensor, fill: float) -> torch.Tensor:
    """``x`` [rows, vocab] as [rows, VOCAB_CHUNKS, vocab / VOCAB_CHUNKS] (padded with ``fill``): a reduction over
    the last dimension then runs in rows x VOCAB_CHUNKS thread blocks on a GPU, where one over the whole vocabulary
    runs in one block a row (32 blocks at 32 rows: 111 µs a step over Qwen's 151,936 tokens on an H200)."""
    width = -(-x.size(-1) // VOCAB_CHUNKS)
    return torch.nn.functional.pad(x, (0, width * VOCAB_CHUNKS - x.size(-1)), value=fill).view(
        x.size(0), VOCAB_CHUNKS, width)


def sample_whole_vocabulary(scores: torch.Tensor, s: Sampling, noise: torch.Tensor | None = None) -> torch.Tensor:
    """``sample`` without top-k and top-p (TRL's default), in chunks of the vocabulary: the exponential race in log
    space, ``argmax(scores / temperature - log E)`` (the argmax of ``p / E``), each chunk's winner first."""
    if not s.do_sample:
        return scores.argmax(dim=-1)
    x = scores / s.temperature if s.temperature != 1.0 else scores
    if s.min_p is not None:  # p >= min_p * max p, in log space
        x = torch.where(x >= x.amax(dim=-1, keepdim=True) + math.log(s.min_p), x, -math.inf)
    if noise is None:
        noise = torch.empty_like(x).exponential_().clamp_min_(TINY)
    keys = in_chunks(x - noise.log(), -math.inf)
    best, where = keys.max(dim=-1)  # each chunk's winner: [rows, chunks]
    chunk = best.argmax(dim=-1)
    return chunk * keys.size(-1) + where.gather(1, chunk[:, None])[:, 0]


def log_prob_at(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits).gather(1, token)``, its normaliser reduced in chunks of the vocabulary."""
    norm = torch.logsumexp(torch.logsumexp(in_chunks(logits, -math.inf), dim=-1), dim=-1)
    return logits.gather(1, token[:, None])[:, 0] - norm


def static_buffer(*shape: int, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Zeros whose address a compiled step may take as fixed (CUDA graphs read and write them in place)."""
    t = torch.zeros(shape, dtype=dtype, device=device)
    torch._dynamo.mark_static_address(t)
    return t


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


GRAPHS_PER_FUNCTION = 64  # torch.compile's limit of graphs of one function, raised for the decoders' (see below)


class OwnStep:
    """What the worker's own decoding steps share (this module's fixed batch, continuous.py's slots): the model they
    run (q/k/v and gate/up fused, a token's query heads packed onto their key/value heads), TRL's sampling
    settings, EOS and padding ids, and the step and prefill compiled. Subclasses define ``_step`` and
    ``_prefill_step``."""

    def _set_up_step(self, trainer, compile: bool, compile_prefill: bool | None, compile_mode: str | None,
                     fuse: bool, step_graphs_of_its_own: bool = False) -> None:
        """``step_graphs_of_its_own``: this decoder's step graphs count against torch.compile's limit of graphs of
        one function (recompile_limit, 8) apart from other decoders' in the process, where torch can."""
        gen = trainer.generation_config
        self.model = generating_model(trainer.accelerator.unwrap_model(trainer.model_wrapped))
        self.unfused = fuse_projections(self.model) if fuse else "not asked"  # why the projections stay apart
        if self.unfused is not None and fuse:
            log.info("[gen] the decoding step keeps q/k/v and gate/up as separate GEMMs: %s", self.unfused)
        self.device = trainer.accelerator.device
        self.max_new = int(gen.max_new_tokens)
        self.sampling = Sampling.of(gen)
        eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        self.eos_ids = {int(e) for e in eos if e is not None}
        self.eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=self.device)
        self.vocab = self.model.get_output_embeddings().weight.size(0)
        self.pad = int(gen.pad_token_id if gen.pad_token_id is not None else eos[0])
        if self.model.config._attn_implementation == "sdpa":
            self.model.set_attn_implementation(PACKED_SDPA)
        on_cuda = self.device.type == "cuda"
        self.compiles, self.compile_mode = compile, compile_mode or ("reduce-overhead" if on_cuda else None)

        # A decoder compiles several graphs of one function (the step's column buckets, the continuous engine's
        # prefill sizes, all again for a longer prompt's cache), each counted in recompiles(). torch.compile's
        # default limit, 8 graphs a function with the 9th failing under fullgraph, is there for runaway recompiles.
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # (before 2.6)
        setattr(config, limit, max(getattr(config, limit), GRAPHS_PER_FUNCTION))

        own = step_graphs_of_its_own and "isolate_recompiles" in inspect.signature(torch.compile).parameters
        self._compiled_step = self._compiled(self._step, **({"isolate_recompiles": True} if own else {}))
        self._compiled_prefill = self._compiled(self._prefill_step) if (compile_prefill is None and on_cuda) \
            or compile_prefill else self._prefill_step

    def _compiled(self, fn, **options):
        """``fn`` compiled as the decoders compile (one whole graph, static shapes unless ``options`` say), or ``fn``
        itself where they do not compile."""
        if not self.compiles:
            return fn
        return torch.compile(fn, **{"fullgraph": True, "dynamic": False, "mode": self.compile_mode, **options})

    def _padded_prompts(self, prompt_ids: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, ...]:
        """The prompts' ids and attention mask, left-padded as TRL pads them, then further on the left to ``width``
        columns (the cache's prompt part: the prefill's one shape), on the CPU."""
        ids = pad([torch.tensor(p) for p in prompt_ids], padding_value=self.pad, padding_side="left",
                  pad_to_multiple_of=self.trainer.pad_to_multiple_of)
        mask = pad([torch.ones(len(p), dtype=torch.long) for p in prompt_ids], padding_value=0, padding_side="left",
                   pad_to_multiple_of=self.trainer.pad_to_multiple_of)
        if width is None:
            return ids, mask
        return (torch.nn.functional.pad(ids, (width - ids.size(1), 0), value=self.pad),
                torch.nn.functional.pad(mask, (width - mask.size(1), 0), value=0))

    def undo(self) -> None:
        """Back to transformers' sdpa attention (compilation failed); TRL's generation settings were never
        changed."""
        if self.model.config._attn_implementation == PACKED_SDPA:
            self.model.set_attn_implementation("sdpa")


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

    @staticmethod
    def unsupported(trainer) -> str | None:
        """Why the step cannot generate for this trainer (it then falls back to compiled generate), or None."""
        why = BehaviourCapture.unsupported(trainer)
        if why is not None:
            return why
        if (path := generation_path(trainer)) is not GenerationPath.OWN:
            return path.value
        model = generating_model(trainer.accelerator.unwrap_model(trainer.model_wrapped))
        if not getattr(model, "_can_compile_fullgraph", False):
            return f"{type(model).__name__} does not declare a static cache that compiles in one graph"
        if getattr(model.config, "is_encoder_decoder", False):
            return "an encoder-decoder model"
        settings = trainer.generation_config.to_diff_dict()
        others = sorted(name for name in settings if name not in IMPLEMENTED)
        if others:
            return "generation settings the step does not implement: " + ", ".join(others)
        if (trainer.generation_config.min_length or 0) > 0:
            return "min_length"
        return None

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
        """Processes ``logits`` (float32, [rows, vocab], straight from the model), picks each row's token, records
        it and its behaviour log-prob at column ``st.step``, and advances the row."""
        s = self.sampling
        scores = logits
        if s.repetition_penalty is not None:
            penalised = torch.where(scores < 0, scores * s.repetition_penalty, scores / s.repetition_penalty)
            scores = torch.where(st.seen[:, :scores.size(-1)], penalised, scores)
        if s.min_new_tokens:
            is_eos = torch.isin(torch.arange(scores.size(-1), device=scores.device), self.eos)
            scores = torch.where(is_eos & (st.step < s.min_new_tokens), -math.inf, scores)
        token = sample(scores, s)
        logp = log_prob_at(logits / s.temperature, token)
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
