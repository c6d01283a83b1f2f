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


# Why ``auto`` does not pick continuous batching yet, by device type (said once at a worker's start).
AUTO_NOT_CONTINUOUS = {
    "cpu": "on a CPU its compilation at a worker's first start (about 50 s at a 4-layer model's shape, cold, "
           "several workers compiling at once) costs more than a short run's decoding saves: the demo's trainer "
           "sets its pace",
    "cuda": "its figures on a GPU are not measured yet",
}


def resolve_mode(mode: str, device_type: str) -> str:
    """``auto``: graph on CUDA, eager on CPU. On the 2-core CPU machine (docs/performance.md) compiling costs tens of
    seconds at a worker's first start, more than a short run's decoding saves."""
    if mode == "auto":
        return "graph" if device_type == "cuda" else "eager"
    return mode


def build_decoder(cfg: AsyncGRPOConfig, trainer, device: WorkerId, events: EventLog) -> Decoder:
    """The worker's decoder for ``--worker_decoding`` and this trainer, compiled and warmed up now, before the first
    claim. Where a mode does not apply it falls back, saying why in one line: continuous to graph, graph to
    compiled, any to eager (turns, TRL's engine, a compilation that fails)."""
    mode = resolve_mode(cfg.worker_decoding, cfg.device_type)
    if cfg.worker_decoding == "auto":
        log.info("[gen] dev%s decodes with %s (--worker_decoding auto), not continuous batching (--worker_decoding "
                 "continuous): %s", device, "TRL's generate" if mode == "eager" else f"its {mode} decoder",
                 AUTO_NOT_CONTINUOUS.get(cfg.device_type, AUTO_NOT_CONTINUOUS["cuda"]))
    if mode == "eager":
        return EagerDecoding(trainer)
    if (path := generation_path(trainer)) is not GenerationPath.OWN:  # turns of varying batch and length
        log.info("[gen] dev%s decodes eagerly: its decoders are for single-turn generation, and this trainer "
                 "generates with %s", device, path.value)
        return EagerDecoding(trainer)
    if mode == "continuous" and (why := ContinuousDecoding.unsupported(trainer)) is not None:
        log.info("[gen] dev%s decodes with its decoding graph instead of continuous batching: %s", device, why)
        mode = "graph"
    if mode == "graph" and (why := GraphDecoding.unsupported(trainer)) is not None:
        log.info("[gen] dev%s decodes with compiled generate instead of its own decoding graph: %s", device, why)
        mode = "compiled"
    rows = list(itertools.islice(trainer.train_dataset, 1024))  # (a streamed dataset has no length)
    prompt_ids, _, _ = getattr(trainer, TOKENIZE_PROMPTS)([row["prompt"] for row in rows])
    if mode == "continuous":
        jobs = cfg.decoding_slots // trainer.args.generation_batch_size if cfg.decoding_slots else (
            4 if cfg.device_type == "cuda" else 2)
        decoding = ContinuousDecoding(trainer, jobs * trainer.args.generation_batch_size, prompt_ids)
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
    log.info("[gen] dev%s compiling its decoding step (%s, batch %d rows, cache %d tokens) before its first job",
             device, mode, decoding.rows_per_call, cache_len)
    try:
        seconds = decoding.warm_up(prompt_ids)
    except Exception as err:  # torch.compile's backends fail in ways of their own: generation works without them
        if is_broken_device_error(err):
            raise
        decoding.undo()
        log.exception("[gen] dev%s %s decoding failed to compile (%s); decoding eagerly", device, mode,
                      first_line(err))
        return EagerDecoding(trainer)
    events.emit("decoding_compiled", dur_ms=seconds * 1e3, graphs=decoding.graphs_after_warm_up,
                rows=decoding.rows_per_call, mode=mode)
    log.info("[gen] dev%s decoding compiled in %.1f s (%s)", device, seconds, mode)
    return decoding
