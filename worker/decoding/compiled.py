"""Compiled ``generate`` (``--worker_decoding compiled``), and what the fixed-batch decoders share.

A static KV cache and the decoding step compiled with ``torch.compile`` (CUDA graphs on a GPU: one launch per
token). The shapes are kept few, so a run compiles a handful of graphs:

- the static cache is sized once, for the longest prompt seen at start-up rounded up to
  PROMPT_BUCKET tokens plus ``max_completion_length`` (transformers' ``max_cache_len``), so a
  decoding step's shapes do not depend on the prompt's length (the prefill runs eagerly);
  a prompt beyond that still generates correctly, with a larger cache and a new graph;
- the batch is fixed: a call generates ``jobs_per_generate`` jobs' rows, a call with fewer
  jobs is filled up with copies of its first row (their completions are thrown away).

``warm_up`` compiles before the worker's first claim, so a job never waits on compilation;
graphs compiled after it are counted (``compiled_graphs``) into the worker's events, its
heartbeat (queue_tools ls) and the report.

CUDA graphs hold the parameters' addresses: weight syncs copy into the parameters' storage
(asyncgrpo/weights), never replace it, so the graphs stay valid across syncs.

transformers compiles ``model.__call__``, hooks included; the worker compiles ``model.forward``
instead and hands the result to generate as the model's compiled call (CompiledDecodeStep):
behaviour-log-prob capture (worker/behaviour.py) observes each step outside the graph.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import CompileConfig

from worker.decoding import Generation
from worker.decoding.compiled_step import (
    COMPILED_CALL,
    LAST_COMPILE_CONFIG,
    CompiledDecodeStep,
    compiled_graphs,
    generating_model,
)
from worker.decoding.eager import EagerDecoding
from worker.decoding.shapes import bucketed
from worker.in_flight import InFlightWeights

log = logging.getLogger("asyncgrpo.worker")

class FixedBatchDecoding:
    """What compiled and graph decoding share: a fixed batch of ``jobs_per_generate`` jobs' rows (a call with fewer
    is filled up with copies of its first row, their completions thrown away), a warm-up that compiles before the
    first job, and the count of graphs compiled after it. ``generate_batch`` generates a full batch."""

    def __init__(self, trainer, jobs_per_generate: int):
        self.trainer = trainer
        self.rows_per_call = trainer.args.generation_batch_size * jobs_per_generate
        self.graphs_after_warm_up: int | None = None

    def generate(self, prompt_ids: list[list[int]], seed: int,
                 in_flight: InFlightWeights | None = None) -> Generation:
        generation = self.generate_batch(self.pad_batch(prompt_ids), seed, in_flight)
        generation.completion_ids = generation.completion_ids[:len(prompt_ids)]
        return generation

    def generate_batch(self, prompt_ids: list[list[int]], seed: int,
                       in_flight: InFlightWeights | None = None) -> Generation:
        raise NotImplementedError

    def pad_batch(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """``prompt_ids`` filled up to the fixed batch with copies of the first row."""
        return prompt_ids + [prompt_ids[0]] * max(0, self.rows_per_call - len(prompt_ids))

    # Calls that compile and record: the first compiles the step, the second runs it after a fresh cache, recording
    # CUDA graphs.
    WARM_UP_CALLS = 2

    def warm_up(self, prompt_ids: list[list[int]]) -> float:
        """Compiles by generating one full batch of ``prompt_ids`` WARM_UP_CALLS times; returns the seconds it
        took."""
        start = time.monotonic()
        batch = self.pad_batch(prompt_ids[: self.rows_per_call])
        for _ in range(self.WARM_UP_CALLS):
            with torch.no_grad(), self.trainer.accelerator.autocast():
                self.generate_batch(batch, seed=0)
        self.graphs_after_warm_up = compiled_graphs()
        return time.monotonic() - start

    def recompiles(self) -> int:
        """Graphs compiled since the warm-up."""
        return compiled_graphs() - (self.graphs_after_warm_up or 0)


class CompiledDecoding(FixedBatchDecoding, EagerDecoding):
    """Compiled decoding on a worker's trainer (see the module's docstring): TRL's generate call, as eager decoding
    makes it, over a fixed batch, with the generation config set for a static cache and a compiled step."""

    mode = "compiled"

    def __init__(self, trainer, jobs_per_generate: int, prompt_ids: list[list[int]]):
        super().__init__(trainer, jobs_per_generate)
        self.prompt_tokens = bucketed(max((len(ids) for ids in prompt_ids), default=1))
        gen = trainer.generation_config
        self._eager = {name: getattr(gen, name) for name in
                       ("cache_implementation", "max_cache_len", "disable_compile", "compile_config")}
        self._eager_cache_kwarg = trainer.generation_kwargs.get("cache_implementation")
        gen.cache_implementation = "static"
        gen.max_cache_len = self.prompt_tokens + trainer.max_completion_length
        gen.disable_compile = False
        on_cuda = trainer.accelerator.device.type == "cuda"
        gen.compile_config = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead" if on_cuda else None)
        gen.compile_config._compile_all_devices = not on_cuda  # transformers compiles on accelerators only otherwise
        trainer.generation_kwargs["cache_implementation"] = "static"  # what TRL sets on the model while generating
        self.model = generating_model(trainer.accelerator.unwrap_model(trainer.model_wrapped))
        setattr(self.model, COMPILED_CALL, CompiledDecodeStep(self.model, gen.compile_config))
        setattr(self.model, LAST_COMPILE_CONFIG, gen.compile_config)

    def undo(self) -> None:
        """Back to TRL's eager generation (compilation failed)."""
        for name, value in self._eager.items():
            setattr(self.trainer.generation_config, name, value)
        self.trainer.generation_kwargs["cache_implementation"] = self._eager_cache_kwarg
        for name in (COMPILED_CALL, LAST_COMPILE_CONFIG):
            self.model.__dict__.pop(name, None)

    def generate_batch(self, prompt_ids: list[list[int]], seed: int,
                       in_flight: InFlightWeights | None = None) -> Generation:
        return EagerDecoding.generate(self, prompt_ids, seed, in_flight)
