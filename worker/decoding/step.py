"""What the worker's own decoding steps share (worker/decoding/graph.py's fixed batch, continuous.py's slots): the
model they run, TRL's sampling settings, the logits-to-token function every step calls, and how they compile.

``next_token`` is a step's last part, in transformers' order: the logits processing TRL's generation config asks
for (repetition penalty, ``min_new_tokens``, temperature, top-k, top-p, min-p; top-p and min-p on the top-k
survivors when top-k is set: no sort of the whole vocabulary; tokens tied with the k-th are cut, which
transformers keeps), then

- sampling without a host sync: the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` (drawn from the device's
  generator, or given: the engine's seeded draws, worker/decoding/seeded_draws.py), which picks token i with
  probability ``p_i / sum(p)`` as ``torch.multinomial`` does; greedy (``do_sample=False``) takes the argmax.
  Without top-k and top-p the race runs in log space over chunks of the vocabulary (``in_chunks``);
- the chosen token's behaviour log-prob with the definition worker/behaviour.py captures (TRL's recomputation):
  ``log_softmax(logits / temperature)`` at the token, from the logits before any processing.

What the steps do not implement (``OwnStep.unsupported``) falls back to compiled ``generate``
(worker/decoding/build.py decides).
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass

import torch
import transformers
from transformers import GenerationConfig
from trl.trainer.utils import pad

from worker.behaviour import BehaviourCapture
from worker.decoding.attention import PACKED_SDPA
from worker.decoding.compiled_step import generating_model
from worker.decoding.fused_projections import fuse_projections
from worker.trl_seam import GenerationPath, generation_path

log = logging.getLogger("asyncgrpo.worker")

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


def next_token(logits: torch.Tensor, s: Sampling, eos: torch.Tensor, seen: torch.Tensor | None,
               count: torch.Tensor, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token and its behaviour log-prob from ``logits`` (float32 [rows, vocab], straight from the
    model): penalised where ``seen`` ([rows, vocab + 1] booleans, with a repetition penalty), EOS barred while
    ``count`` (the tokens a row has sampled: a tensor, one or a row's each) is under ``min_new_tokens``, sampled
    with ``noise`` (see ``sample``)."""
    scores = logits
    if s.repetition_penalty is not None:
        penalised = torch.where(scores < 0, scores * s.repetition_penalty, scores / s.repetition_penalty)
        scores = torch.where(seen[:, :scores.size(-1)], penalised, scores)
    if s.min_new_tokens:
        is_eos = torch.isin(torch.arange(scores.size(-1), device=scores.device), eos)
        under = (count < s.min_new_tokens).reshape(-1, 1)  # (one count for every row, or a row's each)
        scores = torch.where(is_eos & under, -math.inf, scores)
    token = sample(scores, s, noise)
    return token, log_prob_at(logits / s.temperature, token)


GRAPHS_PER_FUNCTION = 64  # torch.compile's limit of graphs of one function, raised for the decoders' (see below)


class OwnStep:
    """What the worker's own decoding steps share (graph.py's fixed batch, continuous.py's slots): the model they
    run (q/k/v and gate/up fused, a token's query heads packed onto their key/value heads), TRL's sampling
    settings, EOS and padding ids, and the step and prefill compiled. Subclasses define ``_step`` and
    ``_prefill_step``."""

    @staticmethod
    def unsupported(trainer) -> str | None:
        """Why the own decoding steps cannot generate for this trainer (the worker then decodes with compiled
        generate), or None."""
        why = BehaviourCapture.unsupported(trainer)
        if why is not None:
            return why
        if (path := generation_path(trainer)) is not GenerationPath.OWN:
            return path.value
        model = generating_model(trainer.accelerator.unwrap_model(trainer.model_wrapped))
        if not getattr(model, "_can_compile_fullgraph", False):
            return f"{type(model).__name__} does not declare a static cache that compiles in one graph"
        if "cache" not in inspect.signature(model.forward).parameters:  # (older transformers: past_key_values)
            return (f"{type(model).__name__}.forward takes no cache= (transformers {transformers.__version__}: the "
                    f"steps hand the cache over as transformers 5.24 names it)")
        if getattr(model.config, "is_encoder_decoder", False):
            return "an encoder-decoder model"
        settings = trainer.generation_config.to_diff_dict()
        others = sorted(name for name in settings if name not in IMPLEMENTED)
        if others:
            return "generation settings the step does not implement: " + ", ".join(others)
        if (trainer.generation_config.min_length or 0) > 0:
            return "min_length"
        return None

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
