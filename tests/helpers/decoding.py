"""The decoders' test builders, shared by tests/worker's decoder tests: small Llamas over the demo tokenizer whose
greedy completions vary, trainers, prompts and jobs, transformers' generate and TRL's log-probs to compare
against, the sampling-distribution check, and an EventLog that keeps what it is given.

Imported as ``helpers.decoding`` (not re-exported by ``helpers``: it imports transformers and TRL, which the
processes that import ``helpers`` alone need not pay for).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer, repeat_digit_reward
from worker.decoding.graph import GraphDecoding
from worker.decoding.step import Sampling
from worker.generate import JobInput, build_trainer
from worker.trl_seam import BEHAVIOUR_LOGPS

from .configs import demo_config

SHAPES = {"demo": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96),
          "larger": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=448)}
# Prompts of 2 to 12 tokens: left padding of every width.
PROMPTS = ["7:", "12 3:", "9 9 9 9:", "0 1:", "5:", "3 3:", "1 2 3 4 5 6:", "8:"]
GREEDY = {"generation_kwargs": {"do_sample": False}, "max_completion_length": 24}
SAMPLING = {"temperature": 0.9, "top_k": 5, "top_p": 0.9, "max_completion_length": 12}


def llama(shape: str = "demo", seed: int = 0, eos_bias: float = 0.0, kv_heads: int = 4) -> LlamaForCausalLM:
    """A Llama over the demo tokenizer whose greedy completions vary (initializer_range 0.3: some rows end early,
    some never), deterministic given ``seed``; ``eos_bias`` added to EOS's output embedding makes it likelier."""
    tok = build_tokenizer()
    config = LlamaConfig(**SHAPES[shape], num_key_value_heads=kv_heads, vocab_size=len(tok), initializer_range=0.3,
                         max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if eos_bias:
        with torch.no_grad():
            model.lm_head.weight[tok.eos_token_id] += eos_bias * model.model.norm.weight
    return model


def trainer_for(tmp_path, model=None, **overrides):
    tok = build_tokenizer()
    return build_trainer(demo_config(tmp_path, **overrides), model if model is not None else llama(), tok,
                         [repeat_digit_reward], build_dataset(n=40))


def gpu_trainer(tmp_path, **overrides):
    """A sampling trainer on the GPU, bf16. The demo's own model (initializer_range 0.02): bf16 rounds a logit to
    0.4% of its size, and the sharper logits of llama()'s (0.3) would move log-probs by more than the tolerance."""
    trainer = trainer_for(tmp_path, build_model(seed=0, tokenizer=build_tokenizer()), use_cpu=False,
                          device_type="cuda", bf16=True, **{**SAMPLING, **overrides})
    trainer.model.to("cuda")
    return trainer


def prompt_ids(trainer, prompts=PROMPTS) -> list[list[int]]:
    return [[int(t) for t in ids] for ids in trainer._tokenize_prompts(prompts)[0]]


def generated(trainer, ids) -> list[list[int]]:
    """transformers' generate, as TRL's _generate_single_turn calls it."""
    with torch.no_grad():
        return trainer._generate_single_turn(ids, None, {}, trainer.num_generations)[0]


def decoded(decoding: GraphDecoding, ids) -> list[list[int]]:
    with torch.no_grad():
        return decoding.decode_batch(decoding.pad_batch(ids))[0][: len(ids)]


# Prompts of 2 to 9 tokens (one token per character): a shared call left-pads them to the longest.
VARIED_PROMPTS = ["7:", "12 3:", "9 9 9 9:", "0 1:"]


# Four prompts a job (x 8 generations: 32 rows); rows of every length, some never ending.
JOB_PROMPTS = [["7:", "12 3:", "9 9 9 9:", "0 1:"], ["5:", "3 3:", "1 2 3 4 5 6:", "8:"], ["4 4:", "2:", "6 0:", "1:"],
               ["3:", "45 6:", "8:", "1 1 1:"], ["0:", "9:", "2 7:", "5 5 5:"]]


def job_ids(trainer, index: int) -> list[list[int]]:
    return prompt_ids(trainer, [p for p in JOB_PROMPTS[index] for _ in range(trainer.num_generations)])


def job(index: int, prompts: list[str], trainer) -> JobInput:
    rows = [{"prompt": p} for p in prompts for _ in range(trainer.num_generations)]
    return JobInput(rows, seed=index, fields={"job_id": f"000000_{index:03d}"})


def two_jobs(trainer) -> list[JobInput]:
    return [job(0, VARIED_PROMPTS, trainer), job(1, ["3:", "45 6:", "8:", "1 1 1:"], trainer)]


def counted(trainer, obj, name) -> list:
    """Counts calls of ``obj.name`` (an instance attribute over the method, removed by the caller)."""
    calls, method = [], getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


def trl_logps(trainer, batch) -> torch.Tensor:
    device = trainer.accelerator.device
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1).to(device)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1).to(device)
    with torch.no_grad():
        logps, _, _ = getattr(type(trainer), BEHAVIOUR_LOGPS)(trainer, trainer.model, ids, mask,
                                                            batch["completion_ids"].size(1))
    return logps.cpu()


def assert_captured_within_bf16_of_trls(trainer, outcomes):
    # bf16 autocast: the decoding kernels and TRL's full forward round differently; 0.05 bounds a token's log-prob
    # difference there, where a wrong token or a stale weight differs by whole units.
    for outcome in outcomes:
        assert not isinstance(outcome, Exception), outcome
        batch = outcome.batch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            diff = (batch["old_per_token_logps"] - trl_logps(trainer, batch)).abs() * batch["completion_mask"]
        assert diff.max().item() < 0.05


class Events:
    """An EventLog that keeps what it is given."""

    def __init__(self):
        self.emitted = []

    def emit(self, event, **fields):
        self.emitted.append((event, fields))

    @contextlib.contextmanager
    def span(self, name, **fields):
        self.emit(f"{name}_start", **fields)
        yield {}
        self.emit(f"{name}_end", **fields)


# ---------------------------------------------------------------- the distribution: sampling is multinomial's

def expected_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """What transformers samples from: its warpers, in its order, then softmax."""
    scores = logits[None].clone()
    warpers = [TemperatureLogitsWarper(s.temperature) if s.temperature != 1.0 else None,
               TopKLogitsWarper(s.top_k) if s.top_k else None, TopPLogitsWarper(s.top_p) if s.top_p else None,
               MinPLogitsWarper(s.min_p) if s.min_p else None]
    for warper in filter(None, warpers):
        scores = warper(None, scores)
    return torch.softmax(scores, dim=-1)[0]


SETTINGS = {"temperature": dict(temperature=0.6),
            "top_k": dict(temperature=1.0, top_k=4),
            "top_p": dict(temperature=1.0, top_p=0.8),
            "min_p": dict(temperature=1.0, min_p=0.15),
            "all": dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05)}
DRAWS = 40_000
CHI2_LIMIT = 35.0  # chi-square with at most 9 degrees of freedom: p < 1e-4 beyond this


def assert_drawn_from(tokens: torch.Tensor, want: torch.Tensor) -> None:
    """``tokens`` (DRAWS of them) are drawn from the distribution ``want``: none that it filters out, and the
    counts of the others within a chi-square test's limit."""
    counts = torch.bincount(tokens, minlength=want.numel()).double()
    assert (counts[want == 0] == 0).all(), f"drew filtered tokens: {counts.tolist()} for {want.tolist()}"
    kept = want > 0
    expected = want[kept].double() * DRAWS
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_LIMIT, f"chi2 {chi2:.1f}: drawn {counts.tolist()}, expected {(want * DRAWS).tolist()}"
    assert kept.sum() >= 2  # a real distribution, not one token


NO_WARPER = dict(do_sample=True, temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
                 min_new_tokens=0)
