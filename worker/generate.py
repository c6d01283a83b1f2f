"""Generation and scoring on a worker, by TRL's own code path.

A worker holds a GRPOTrainer that never trains: ``_generate_and_score_completions`` on a
job's rows generates, scores with the reward functions and computes advantages exactly
as TRL does. TRL only computes the behaviour log-probs (``old_per_token_logps``) when
generation and optimisation steps are misaligned; here every result may be trained on
by newer weights, so the worker always computes them with the weights it generated
with, using TRL's ``_get_per_token_logps_and_entropies``. The PS's loss then clips the
ratio current/behaviour as TRL's loss does: stale samples are corrected, not ignored.

Generation and scoring are timed apart by wrapping TRL's ``_generate`` for the call.

These three methods are TRL internals (trl 1.16): tests/test_trl_contract.py fails loudly,
naming the method, when they change.
"""

from __future__ import annotations

import statistics
import time
import zlib

import torch
from trl import GRPOTrainer

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.events import EventLog

GENERATE_AND_SCORE = "_generate_and_score_completions"
BEHAVIOUR_LOGPS = "_get_per_token_logps_and_entropies"
GENERATE = "_generate"


def build_trainer(cfg: AsyncGRPOConfig, model, tokenizer, reward_funcs, dataset) -> GRPOTrainer:
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=cfg, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.model.train()  # TRL's "train" mode: train-time num_generations and metric names
    return trainer


def job_seed(seed: int, job_id: str) -> int:
    """The sampling seed of one job: the run's seed and the job id, whichever worker runs it."""
    return (seed * 1_000_003 + zlib.crc32(job_id.encode())) % 2**63


def generate_and_score(trainer: GRPOTrainer, rows: list[dict], events: EventLog, *, seed: int,
                       **job_fields) -> tuple[dict, dict]:
    """One job: (TRL's result dict on the CPU with behaviour log-probs, this job's metrics).

    Sampling is seeded with ``seed`` (see job_seed): every worker's trainer was seeded alike
    at start-up, and without this their samples would run in lockstep. Emits
    generate_start/end and score_start/end events carrying ``job_fields`` (job_id, ...)."""
    torch.manual_seed(seed)
    trainer._metrics["train"].clear()  # metrics of this job only, not cumulative
    generate = getattr(trainer, GENERATE)
    generated_at = []

    def timed_generate(*args, **kwargs):
        with events.span("generate", **job_fields):
            out = generate(*args, **kwargs)
        generated_at.append(time.monotonic())
        events.emit("score_start", **job_fields)
        return out

    setattr(trainer, GENERATE, timed_generate)
    try:
        with torch.no_grad():
            batch = getattr(trainer, GENERATE_AND_SCORE)(rows)
            if "old_per_token_logps" not in batch:
                ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
                mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
                logps, _, _ = getattr(trainer, BEHAVIOUR_LOGPS)(
                    trainer.model, ids, mask, batch["completion_ids"].size(1),
                    batch_size=trainer.args.per_device_train_batch_size)
                batch["old_per_token_logps"] = logps
    finally:
        delattr(trainer, GENERATE)  # back to the class's method
    if generated_at:
        events.emit("score_end", dur_ms=(time.monotonic() - generated_at[0]) * 1e3, **job_fields)
    metrics = {name: statistics.fmean(values) for name, values in trainer._metrics["train"].items() if values}
    trainer._metrics["train"].clear()
    on_cpu = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return on_cpu, metrics
