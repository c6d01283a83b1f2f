"""Which decoder a worker builds (``--worker_decoding``, worker/decoding's four): the one place that decides, from the
flags and the trainer, and falls back where a decoder does not apply, saying why in one line."""

from __future__ import annotations

import itertools
import logging

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.events import EventLog
from asyncgrpo.messages import first_line
from asyncgrpo.run.rundir import WorkerId
from asyncgrpo.weights.device_errors import is_broken_device_error
from worker.decoding import Decoder
from worker.decoding.compiled import CompiledDecoding
from worker.decoding.continuous import ContinuousDecoding
from worker.decoding.eager import EagerDecoding
from worker.decoding.graph import GraphDecoding
from worker.trl_seam import TOKENIZE_PROMPTS, GenerationPath, generation_path

log = logging.getLogger("asyncgrpo.worker")


# ``auto``: on a CPU, continuous batching run eagerly. Uncompiled, at a 2.4M-parameter model's shape, it decodes a long
# tail 3.5-4.2x as many samples/s as TRL's generate (cap 128; 1.7-2.3x at 16-32), and fixed lengths about as fast
# (docs/performance.md, "The default on a CPU"); compiled, about 1.1-1.3x more again, for a compilation of about
# 50 s at a machine's first worker start.
AUTO_ON_CPU = ("continuous batching, run eagerly (--worker_decoding auto on a CPU: compiling it, "
               "--worker_decoding continuous, decodes 1.1-1.3x faster for tens of seconds of compilation at a "
               "worker's first start)")
# Not for a model so small that its forward is a few tiny operations: the eager engine's own per-step operations
# (the slots' bookkeeping, the seeded draws) are then most of a step. The demo's model (71k parameters) decoded a job
# in 1.6-2.1x generate's CPU time at every completion cap from 8 to 64 tokens (no tail: its completions run to the
# cap), and the demo end to end took 38 s against 35 with generate, to the same rewards.
ENGINE_MIN_PARAMETERS_ON_CPU = 1_000_000
# Why ``auto`` does not pick continuous batching on a GPU yet (said once at a worker's start).
AUTO_NOT_CONTINUOUS_ON_CUDA = "its figures on a GPU are not measured yet"


def resolve_mode(mode: str, device_type: str) -> str:
    """``auto``: graph on CUDA, continuous batching on a CPU (run eagerly: ``compiles``)."""
    if mode == "auto":
        return "graph" if device_type == "cuda" else "continuous"
    return mode


def compiles(cfg: AsyncGRPOConfig) -> bool:
    """Whether the worker's decoder compiles at its start: all but eager ones and ``auto``'s on a CPU."""
    return resolve_mode(cfg.worker_decoding, cfg.device_type) != "eager" and not eager_engine(cfg)


def eager_engine(cfg: AsyncGRPOConfig) -> bool:
    return cfg.worker_decoding == "auto" and cfg.device_type != "cuda"


def too_small(trainer) -> str | None:
    """Why the engine would decode more slowly than TRL's generate on a CPU for this trainer's model, or None."""
    parameters = trainer.accelerator.unwrap_model(trainer.model).num_parameters()
    if parameters < ENGINE_MIN_PARAMETERS_ON_CPU:
        return (f"a model of {parameters:,} parameters, whose decoding step on a CPU costs less than the engine's own "
                f"bookkeeping (the engine pays from {ENGINE_MIN_PARAMETERS_ON_CPU:,})")
    return None


def build_decoder(cfg: AsyncGRPOConfig, trainer, device: WorkerId, events: EventLog) -> Decoder:
    """The worker's decoder for ``--worker_decoding`` and this trainer, compiled and warmed up now, before the first
    claim. Where a mode does not apply it falls back, saying why in one line: continuous to graph, graph to
    compiled, any to eager (turns, TRL's engine, a compilation that fails)."""
    mode = resolve_mode(cfg.worker_decoding, cfg.device_type)
    if cfg.worker_decoding == "auto" and mode != "continuous":
        log.info("[gen] dev%s decodes with its %s decoder (--worker_decoding auto), not continuous batching "
                 "(--worker_decoding continuous): %s", device, mode, AUTO_NOT_CONTINUOUS_ON_CUDA)
    if mode == "eager":
        return EagerDecoding(trainer)
    if (path := generation_path(trainer)) is not GenerationPath.OWN:  # turns of varying batch and length
        log.info("[gen] dev%s decodes eagerly: its decoders are for single-turn generation, and this trainer "
                 "generates with %s", device, path.value)
        return EagerDecoding(trainer)
    if eager_engine(cfg) and (why := ContinuousDecoding.unsupported(trainer) or too_small(trainer)) is not None:
        log.info("[gen] dev%s decodes with TRL's generate (--worker_decoding auto), not continuous batching: %s",
                 device, why)
        return EagerDecoding(trainer)
    if mode == "continuous" and (why := ContinuousDecoding.unsupported(trainer)) is not None:
        log.info("[gen] dev%s decodes with its decoding graph instead of continuous batching: %s", device, why)
        mode = "graph"
    elif mode == "continuous" and cfg.device_type == "cpu" and (why := too_small(trainer)) is not None:
        log.info("[gen] dev%s decodes with continuous batching as asked, though TRL's generate is faster here "
                 "(--worker_decoding auto picks it): %s", device, why)
    if mode == "graph" and (why := GraphDecoding.unsupported(trainer)) is not None:
        log.info("[gen] dev%s decodes with compiled generate instead of its own decoding graph: %s", device, why)
        mode = "compiled"
    rows = list(itertools.islice(trainer.train_dataset, 1024))  # (a streamed dataset has no length)
    prompt_ids, _, _ = getattr(trainer, TOKENIZE_PROMPTS)([row["prompt"] for row in rows])
    if mode == "continuous":
        jobs = cfg.decoding_slots // trainer.args.generation_batch_size if cfg.decoding_slots else (
            4 if cfg.device_type == "cuda" else cfg.jobs_per_generate)  # (a CPU's: as many as a call would take)
        decoding = ContinuousDecoding(trainer, jobs * trainer.args.generation_batch_size, prompt_ids,
                                      compile=not eager_engine(cfg))
        cache_len = decoding.reads.size
        if not cfg.in_flight_updates:
            log.info("[gen] dev%s continuous batching syncs newer weights between decoding steps, as "
                     "--in_flight_updates does: a result's weights_version is its oldest token's", device)
    elif mode == "graph":
        decoding = GraphDecoding(trainer, cfg.jobs_per_generate, prompt_ids)
        cache_len = decoding.state.cache_len
    else:
        decoding = CompiledDecoding(trainer, cfg.jobs_per_generate, prompt_ids)
        cache_len = trainer.generation_config.max_cache_len
    if eager_engine(cfg):
        log.info("[gen] dev%s decodes with %s: %d row slots, cache %d tokens", device, AUTO_ON_CPU,
                 decoding.rows_per_call, cache_len)
    else:
        log.info("[gen] dev%s compiling its decoding step (%s, batch %d rows, cache %d tokens) before its first job",
                 device, mode, decoding.rows_per_call, cache_len)
    try:
        seconds = decoding.warm_up(prompt_ids)
    except Exception as err:  # torch.compile's backends fail in ways of their own, the engine on a model it cannot
        # run too: generation works without them
        if is_broken_device_error(err):
            raise
        decoding.undo()
        log.exception("[gen] dev%s %s decoding failed %s (%s); decoding eagerly", device, mode,
                      "to compile" if compiles(cfg) else "its trial job", first_line(err))
        return EagerDecoding(trainer)
    if not compiles(cfg):
        log.info("[gen] dev%s decoding tried on one job in %.1f s (%s, nothing compiled)", device, seconds, mode)
        return decoding
    events.emit("decoding_compiled", dur_ms=seconds * 1e3, graphs=decoding.graphs_after_warm_up,
                rows=decoding.rows_per_call, mode=mode)
    log.info("[gen] dev%s decoding compiled in %.1f s (%s)", device, seconds, mode)
    return decoding
