"""How a worker decodes (``--worker_decoding``): the one place that decides, from the flags and the trainer, which
decoder a worker builds, and falls back where one does not apply (``build_decoder``).

- eager: TRL's own ``generate`` call as TRL configures it (a dynamic KV cache, compilation off): one forward per
  token, each a few hundred kernel launches from Python;
- compiled: ``generate`` with a static KV cache and its decoding step compiled (worker/compiled.py);
- graph: the worker's own decoding step, forward, sampling and bookkeeping of a token in one compiled function
  (worker/decode_step.py), a fixed batch of ``--jobs_per_generate`` jobs' rows;
- continuous: that step over ``--decoding_slots`` row slots, a job's rows joining as slots free up
  (worker/continuous.py, its loop worker/continuous_loop.py).

Every one of them generates a single-turn job in one call and hands it to TRL's scoring as a replay
(worker/generate.py); jobs whose generation is TRL's own (turns with tools, an environment or a rollout function;
TRL's engine: worker/trl_seam.py ``generation_path``) are generated eagerly by TRL.
"""

from __future__ import annotations

import itertools
import logging

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.events import EventLog
from asyncgrpo.messages import first_line
from asyncgrpo.run.rundir import WorkerId
from asyncgrpo.weights.device_errors import is_broken_device_error
from worker.compiled import CompiledDecoding
from worker.continuous import ContinuousDecoding
from worker.decode_step import GraphDecoding
from worker.trl_seam import TOKENIZE_PROMPTS, GenerationPath, generation_path

log = logging.getLogger("asyncgrpo.worker")


def resolve_mode(mode: str, device_type: str) -> str:
    """``auto``: graph on CUDA, eager on CPU. On the 2-core CPU machine (docs/performance.md) compiling costs 10-35 s
    per batch shape at every worker start, more than a short run's decoding saves."""
    if mode == "auto":
        return "graph" if device_type == "cuda" else "eager"
    return mode


def build_decoder(cfg: AsyncGRPOConfig, trainer, device: WorkerId,
                  events: EventLog) -> CompiledDecoding | GraphDecoding | ContinuousDecoding | None:
    """The worker's decoder for ``--worker_decoding`` and this trainer, compiled and warmed up now, before the first
    claim; None: eager (TRL's generate). Where a mode does not apply it falls back, saying why in one line:
    continuous to graph, graph to compiled, any to eager (turns, TRL's engine, a compilation that fails)."""
    mode = resolve_mode(cfg.worker_decoding, cfg.device_type)
    if mode == "eager":
        return None
    if (path := generation_path(trainer)) is not GenerationPath.OWN:  # turns of varying batch and length
        log.info("[gen] dev%s decodes eagerly: its decoders are for single-turn generation, and this trainer "
                 "generates with %s", device, path.value)
        return None
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
        cache_len = decoding.columns
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
        return None
    events.emit("decoding_compiled", dur_ms=seconds * 1e3, graphs=decoding.graphs_after_warm_up,
                rows=decoding.rows_per_call, mode=mode)
    log.info("[gen] dev%s decoding compiled in %.1f s (%s)", device, seconds, mode)
    return decoding
