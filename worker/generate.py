"""Generation and scoring on a worker, by TRL's own code path.

A worker holds a GRPOTrainer that never trains: ``_generate_and_score_completions`` on a
job's rows generates, scores with the reward functions and computes advantages exactly
as TRL does. TRL only computes the behaviour log-probs (``old_per_token_logps``) when
generation and optimisation steps are misaligned; here every result may be trained on
by newer weights, so the worker supplies them, from the weights it generated with. The
PS weights each token by the truncated ratio current/behaviour (ps/offpolicy.py): stale
samples are corrected, not ignored.

The behaviour log-probs are captured during generation (worker/behaviour.py): generate's
own forward passes already compute every sampled token's logits, so the second forward
pass over every completion (TRL's ``_get_per_token_logps_and_entropies``) only runs
where capture does not apply. Except in synchronous mode (``max_staleness == 0``):
there the PS trains with the weights the worker generated with, so the key is left out and
the PS's ratio current/behaviour is TRL's exact 1 (captured log-probs differ from the
trainer's forward pass by rounding: sent, they would part a synchronous run from TRL's
after some dozens of steps, docs/performance.md "The lookup task against TRL").

Generation and scoring are timed apart, and what the job needs is read off TRL's call, by the overrides of
worker/trl_seam.py (the one place that names TRL's internals).

Several jobs share one generate call (generate_jobs, ``--jobs_per_generate``): where decoding is
bound by kernel launches, a larger batch costs little more per call. Each job is then scored
by its own TRL call, whose ``_generate_single_turn`` returns that job's completions.

A job that raises is described by ``error_record`` (which reward function, from TRL's frames in
the traceback), and with ``--log_completions`` the rows TRL logged for its completions table
(``_logs``) travel with the result, for the PS to print (``completion_logs``).

These TRL internals (trl 1.16), and the transformers generation behaviour capture relies
on, are checked by tests/test_trl_contract.py, which fails loudly, naming what changed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import math
import numbers
import random
import reprlib
import statistics
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.profiler import record_function
from trl import GRPOTrainer
from trl.trainer.utils import disable_dropout_in_model, get_callable_name, is_async_callable

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue.handoff import REWARDS_KEY
from asyncgrpo.messages import RepeatedFailureLog, first_line, log_once
from asyncgrpo.user_code import RolloutHooks
from asyncgrpo.weights.device_errors import is_broken_device_error
from worker.behaviour import BehaviourCapture, MultiTurnCapture, capture_for
from worker.deadline import ACTIVITY
from worker.decoding import Decoder
from worker.decoding.eager import EagerDecoding
from worker.in_flight import InFlightWeights
from worker.tools import RolloutTurns, WorkerStopping, bounding_environments
from worker.trl_seam import (
    BEHAVIOUR_LOGPS,
    CALCULATE_REWARDS,
    COMPLETION_LOGS,
    GENERATE,
    GENERATE_AND_SCORE,
    METRICS,
    TOKENIZE_PROMPTS,
    GenerationPath,
    Pregenerated,
    generation_path,
    scoring_one_job,
)

log = logging.getLogger("asyncgrpo.worker")


def build_trainer(cfg: AsyncGRPOConfig, model, tokenizer, reward_funcs, dataset,
                  hooks: RolloutHooks | None = None) -> GRPOTrainer:
    # A job is one generation batch whatever steps_per_generation and num_iterations are: seen with
    # one generation per optimizer step, TRL leaves old_per_token_logps to us (captured, not recomputed).
    args = copy.copy(cfg)
    args.steps_per_generation, args.num_iterations = cfg.gradient_accumulation_steps, 1
    # A job is the PS's global generation batch: per_device_train_batch_size rows for each of its processes.
    # TRL generates for every row it is given, but sizes its completions table by this (rows beyond it dropped).
    args.generation_batch_size = cfg.generation_batch_size * cfg.ps_processes
    args.eval_strategy = "no"  # the PS evaluates (TRL's Trainer refuses an eval_strategy without eval data)
    # TRL fills its completions table (_logs) whatever this says; the PS prints it (worker/loop.py sends the rows).
    args.log_completions = False
    # --fsdp shards the PS's model across its processes; a worker is one process holding the whole model
    # (transformers' Trainer refuses fsdp outside distributed training).
    args.fsdp, args.fsdp_plugin_args = False, None
    # The same peft_config as the PS's: the same adapter modules, so the same trainable names to sync into;
    # with beta > 0 TRL's reference log-probs are the base's, with the adapter disabled (no second model).
    hooks = hooks or RolloutHooks()
    # Tools (an environment's methods too) run on this worker under --tool_timeout_s (worker/tools.py), and so do
    # an environment's reset() and get_reward().
    reward_funcs = reporting_slow_rewards(reward_funcs)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=cfg.peft_config(), **hooks.trainer_kwargs())
    bounding_environments(trainer, cfg.tool_timeout_s)
    trainer.model.train()  # TRL's "train" mode: train-time num_generations and metric names
    # ... but no dropout (LoRA's included): the behaviour log-probs must be those of the policy the PS trains,
    # not of one random dropout mask per sample.
    disable_dropout_in_model(trainer.model)
    return trainer


# The worker's [jobs] lines, which launch.sh shows: a failed job's error or a slow reward, each kind's first at
# once, then counted once a minute (a reward raising on some prompts, or a judge taking over a minute a job, would
# otherwise be a line a job; worker/loop.py logs failed jobs and flushes the counts).
JOB_FAILURES = RepeatedFailureLog(log, "jobs")
SLOW_REWARD_S = 60.0


def reporting_slow_rewards(reward_funcs: list, after_s: float | None = None) -> list:
    """Each reward function (a callable, not a reward model), wrapped to log a [jobs] line, which launch.sh
    shows, when a call has run for ``after_s`` (SLOW_REWARD_S) without returning: a reward that hangs (a judge
    or a sandbox that never answers) would otherwise stall the run with no word of where. The call is not cut:
    sync reward functions run on the worker's main thread as in TRL, where some rely on being (signal-based
    timeouts, as math_verify's). TRL names a reward by its callable's name and runs async ones together: both
    are kept. What the function returns is checked (``scored``)."""
    after_s = SLOW_REWARD_S if after_s is None else after_s
    return [function if isinstance(function, (str, torch.nn.Module)) or not callable(function)
            else _watched(function, after_s) for function in reward_funcs]


def _watched(function, after_s: float):
    name = get_callable_name(function)

    def report():
        JOB_FAILURES.failed(f"reward function {name!r} has run for {after_s:g} s and not returned: the job waits "
                            "for it, and the trainer for the job")

    if is_async_callable(function):
        async def watched(*args, **kwargs):
            with _reported_after(after_s, report), ACTIVITY.doing("reward function", name):
                return scored(name, await function(*args, **kwargs))
    else:
        def watched(*args, **kwargs):
            with _reported_after(after_s, report), ACTIVITY.doing("reward function", name):
                return scored(name, function(*args, **kwargs))
    watched = functools.update_wrapper(watched, function, assigned=("__module__", "__doc__"), updated=())
    watched.__name__ = watched.__qualname__ = name
    return watched


def scored(name: str, rewards):
    """``rewards`` as TRL reads them (a number, or None for a completion the function does not score), each value
    that is neither a finite number nor None (nor NaN, which TRL reads as None) replaced by None and named in a
    [jobs] line: inf, or a string, would otherwise reach the advantages and the loss, or fail the job in TRL's
    conversion. The other completions are scored as they were."""
    if not isinstance(rewards, list):
        return rewards  # (TRL's own error names what it got)
    checked = []
    for value in rewards:
        one_element = isinstance(value, torch.Tensor | np.ndarray) and np.prod(value.shape) == 1
        number = value.item() if one_element else value
        if number is None or (isinstance(number, numbers.Real) and (math.isfinite(number) or math.isnan(number))):
            checked.append(value)
            continue
        JOB_FAILURES.failed(f"reward function {name!r} returned {reprlib.repr(value)}, not a finite number: that "
                            "completion counts as not scored by it, as with None")
        checked.append(None)
    return checked


@contextlib.contextmanager
def _reported_after(seconds: float, report):
    timer = threading.Timer(seconds, report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def job_seed(seed: int, job_id: str) -> int:
    """The sampling seed of one job: the run's seed and the job id, whichever worker runs it."""
    return (seed * 1_000_003 + zlib.crc32(job_id.encode())) % 2**63


@dataclass
class JobInput:
    """One job to generate: its rows, sampling seed (job_seed), the PS's step when thrown, and the fields its
    events carry (job_id, weights_version)."""

    rows: list[dict]
    seed: int
    ps_step: int = 0
    fields: dict = field(default_factory=dict)


@dataclass
class Generated:
    """One job generated and scored: its batch and metrics as generate_and_score returns them, its completions
    table (completion_logs) when asked for, and with in-flight updates the versions its tokens were sampled by
    (runs [(first_token, version), ...] a row, worker/in_flight.py)."""

    batch: dict
    metrics: dict
    logs: dict | None = None
    token_versions: list[list[tuple[int, int]]] | None = None


def generate_jobs(trainer: GRPOTrainer, jobs: list[JobInput], events: EventLog, decoder: Decoder | None = None,
                  with_logs: bool = False, in_flight: InFlightWeights | None = None) -> list[Generated | Exception]:
    """Several jobs, generated in one call of ``decoder`` (worker/decoding; None: TRL's eager generate) where that
    applies, each scored on its own: for each job, what it generated (Generated), or the exception its generation
    or scoring raised (one job's reward function raising fails that job alone). An error that says the device is
    broken is raised. ``in_flight``: newer weights are synced between decoding steps (worker/in_flight.py).

    The rows of all the jobs go through the decoder once, sampled with the first job's seed: a job's samples then
    depend on which jobs shared its call (with one job per call, on its seed alone). If that call raises, the jobs
    are generated one by one, eagerly, so that only a job that fails on its own fails."""
    decoder = decoder or EagerDecoding(trainer)
    shared: list[Pregenerated | None] = [None] * len(jobs)
    shared_versions = None
    if len(jobs) > 1 or decoder.mode != "eager":
        try:
            shared, shared_versions = _generate_together(trainer, jobs, events, decoder, in_flight) or (shared, None)
        except Exception as err:
            if is_broken_device_error(err):
                raise
            log_once(log, f"[gen] generating {len(jobs)} jobs in one call raised {first_line(err)}; generating "
                     "them one by one")
    outcomes: list[Generated | Exception] = []
    for job, pregenerated in zip(jobs, shared, strict=True):
        try:
            batch, metrics = generate_and_score(trainer, job.rows, events, seed=job.seed, ps_step=job.ps_step,
                                                pregenerated=pregenerated, in_flight=in_flight, **job.fields)
            runs = None if in_flight is None else shared_versions if pregenerated else list(in_flight.runs)
            versions = None if runs is None else [runs] * batch["advantages"].size(0)  # every row of the call's
            outcomes.append(Generated(batch, metrics, completion_logs(trainer) if with_logs else None, versions))
        except Exception as err:
            if is_broken_device_error(err):
                raise
            outcomes.append(err)
    return outcomes


def score_generated(trainer: GRPOTrainer, job: JobInput, prompt_ids: list[list[int]],
                    completion_ids: list[list[int]], tokens: torch.Tensor, logps: torch.Tensor, events: EventLog,
                    with_logs: bool = False, token_versions: list[list[tuple[int, int]]] | None = None
                    ) -> Generated | Exception:
    """A job generated elsewhere (worker/decoding/continuous.py: TRL's ``_generate_single_turn`` output for its
    prompts, and the tokens and behaviour log-probs it sampled), scored by TRL's call as a shared call's share is:
    what it generated, or the exception its scoring raised (an error that says the device is broken is raised)."""
    capture = BehaviourCapture(trainer)
    capture.given(tokens, logps)
    try:
        batch, metrics = generate_and_score(trainer, job.rows, events, seed=job.seed, ps_step=job.ps_step,
                                            pregenerated=Pregenerated(prompt_ids, completion_ids, capture),
                                            **job.fields)
    except Exception as err:
        if is_broken_device_error(err):
            raise
        return err
    return Generated(batch, metrics, completion_logs(trainer) if with_logs else None, token_versions)


def prompt_ids_of(trainer: GRPOTrainer, rows: list[dict]) -> list[list[int]] | None:
    """A job's prompts as TRL's ``_generate`` tokenises them before it generates; None for prompts with images."""
    ids, images, multimodal_fields = getattr(trainer, TOKENIZE_PROMPTS)(copy.deepcopy([row["prompt"] for row in rows]))
    if images is not None or multimodal_fields:
        return None
    for row, x in enumerate(ids):
        if len(x) == 0:  # (TRL would pad nothing into a float tensor, and the PS's loss fail on it)
            raise ValueError(f"row {row}'s prompt {rows[row]['prompt']!r:.40} has no token: nothing to generate from")
    return [list(x) for x in ids]


def _generate_together(trainer: GRPOTrainer, jobs: list[JobInput], events: EventLog, decoder: Decoder,
                       in_flight: InFlightWeights | None
                       ) -> tuple[list[Pregenerated], list[tuple[int, int]] | None] | None:
    """One decoder call over the jobs' rows: each job's share, and the call's token versions; None where TRL
    generates them itself (turns and TRL's engine: trl_seam.generation_path; prompts with images)."""
    if generation_path(trainer) is not GenerationPath.OWN:
        return None
    prompt_ids = [prompt_ids_of(trainer, job.rows) for job in jobs]
    if any(ids is None for ids in prompt_ids):
        return None
    for job in jobs:
        events.emit("generate_start", jobs_in_call=len(jobs), **job.fields)
    started = time.monotonic()
    with torch.no_grad(), trainer.accelerator.autocast(), record_function("generate"), ACTIVITY.doing("generation"):
        generation = decoder.generate([ids for per_job in prompt_ids for ids in per_job], jobs[0].seed, in_flight)
    dur_ms = (time.monotonic() - started) * 1e3
    for job in jobs:
        events.emit("generate_end", dur_ms=dur_ms, jobs_in_call=len(jobs), **job.fields)
    shares, start = [], 0
    for ids in prompt_ids:
        stop = start + len(ids)
        shares.append(Pregenerated(ids, generation.completion_ids[start:stop], generation.behaviour.rows(start, stop)))
        start = stop
    return shares, generation.token_versions


def generate_and_score(trainer: GRPOTrainer, rows: list[dict], events: EventLog, *, seed: int, ps_step: int = 0,
                       pregenerated: Pregenerated | None = None, in_flight: InFlightWeights | None = None,
                       **job_fields) -> tuple[dict, dict]:
    """One job: (TRL's result dict on the CPU with behaviour log-probs, this job's metrics).

    The behaviour log-probs are left out only in synchronous mode when they could not be
    captured during generation (see the module's docstring).

    Sampling is seeded with ``seed`` (see job_seed): every worker's trainer was seeded alike
    at start-up, and without this their samples would run in lockstep; so is the scoring (torch, Python's
    ``random`` and numpy's global generator, which reward functions and tools draw from). Emits
    generate_start/end and score_start/end events carrying ``job_fields`` (job_id, ...).

    ``ps_step`` is the PS's step when the job was thrown: reward functions see it as
    ``trainer_state.global_step``, as they would in TRL (a worker never trains).

    Single-turn jobs are generated first (one ``_generate_single_turn`` call, behaviour log-probs captured) and
    then replayed into TRL's scoring, whose ``_generate_single_turn`` returns them instead of generating: the one
    path of every decoder. ``pregenerated``: the job's completions when they were generated already (a call shared
    with other jobs, generate_jobs; the continuous engine). TRL generates inside its scoring call only the turns of
    tools, an environment or a rollout function, and prompts with images. ``in_flight``: newer weights synced
    between decoding steps (worker/in_flight.py), its runs those of this job's generate call."""
    if pregenerated is None:  # single-turn: generated first, then replayed into TRL's scoring, as a shared call is
        job = JobInput(rows, seed, ps_step, job_fields)
        shares, _ = _generate_together(trainer, [job], events, EagerDecoding(trainer), in_flight) or ([None], None)
        pregenerated = shares[0]
    # TRL's set_seed gave every worker's generators the same start (each is its own rank 0): reward functions and
    # tools drawing from Python's or numpy's would run in lockstep on every worker and start over at each restart.
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    trainer.state.global_step = ps_step
    metrics_of = getattr(trainer, METRICS)["train"]
    metrics_of.clear()  # metrics of this job only, not cumulative
    _clear_completion_logs(trainer)  # and its completions table rows only
    capture = capture_for(trainer) if pregenerated is None else pregenerated.capture
    turns = RolloutTurns(trainer.args.tool_timeout_s, events, job_fields) if trainer.tools else None
    # The PS's forward passes run under the trainer's mixed precision (accelerate wraps the model it
    # prepares for training); a worker never trains, so its model is never prepared: the same autocast here,
    # or a float32 base meets TRL's bfloat16 QLoRA adapter in one matmul and every generation fails.
    with torch.no_grad(), trainer.accelerator.autocast(), record_function("score"), \
            ACTIVITY.doing("scoring", job_id=job_fields.get("job_id")), \
            scoring_one_job(trainer, events, job_fields, capture, turns, pregenerated,
                            in_flight if pregenerated is None else None) as seen:
        batch = getattr(trainer, GENERATE_AND_SCORE)(rows)
        if "old_per_token_logps" not in batch:  # TRL computes them only when steps misalign
            _add_behaviour_logps(trainer, batch, capture)
    if turns is not None and turns.stopped:  # its tool calls were cut short: not a result to train on
        raise WorkerStopping("the worker is stopping: tool calls of this job were cut")
    if seen.generated_at is not None:
        events.emit("score_end", dur_ms=(time.monotonic() - seen.generated_at) * 1e3, **job_fields)
    metrics = {name: statistics.fmean(values) for name, values in metrics_of.items() if values}
    metrics_of.clear()
    on_cpu = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    on_cpu[REWARDS_KEY] = _weighted_rewards(trainer, seen.rewards_per_func)
    return on_cpu, metrics


def _weighted_rewards(trainer: GRPOTrainer, rewards_per_func: torch.Tensor) -> torch.Tensor:
    """Each completion's reward as TRL sums it before normalising (NaN where every reward function returned None)."""
    rewards_per_func = rewards_per_func.detach().float().cpu()
    rewards = (rewards_per_func * trainer.reward_weights.float().cpu().unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


def error_record(err: BaseException) -> dict:
    """What a job that raised tells the PS (asyncgrpo.jobqueue.describe_error): the exception's type and
    message, and where: in generation, or in scoring, naming the reward function TRL was calling (the
    ``reward_func_name`` of TRL's ``_calculate_rewards`` frame, ``func_name`` on its async path), also when
    TRL itself raised about that function's output (a wrong number of rewards)."""
    reward_function, stage = None, "scoring"
    calculate_rewards = inspect.unwrap(getattr(GRPOTrainer, CALCULATE_REWARDS)).__code__  # TRL profiles it
    generating = (inspect.unwrap(getattr(GRPOTrainer, GENERATE)).__code__, _generate_together.__code__)
    for frame, _ in traceback.walk_tb(err.__traceback__):
        code = frame.f_code
        if code in generating:
            stage = "generation"
        elif code is calculate_rewards:
            reward_function = frame.f_locals.get("reward_func_name", reward_function)
        elif code.co_name == "_invoke_async" and code.co_filename == calculate_rewards.co_filename:
            reward_function = frame.f_locals.get("func_name", reward_function)
    return {"type": type(err).__name__, "message": str(err)[:2000], "stage": stage,
            "reward_function": reward_function if isinstance(reward_function, str) else None,
            "traceback": "".join(traceback.format_exception(err))[-4000:], "time": time.time()}


def completion_logs(trainer: GRPOTrainer) -> dict:
    """The rows TRL logged for its completions table while generating and scoring the last job, as plain
    values (a result is loaded with weights_only=True): prompt, completion, rewards per function,
    advantages, extra columns (a reward function's log_extra). Images are not sent."""
    logs = getattr(trainer, COMPLETION_LOGS)
    return {"prompt": _plain(list(logs["prompt"])), "completion": _plain(list(logs["completion"])),
            "rewards": {name: _plain(list(values)) for name, values in logs["rewards"].items()},
            "advantages": _plain(list(logs["advantages"])),
            "extra": {str(name): _plain(list(values)) for name, values in logs["extra"].items()}}


def _clear_completion_logs(trainer: GRPOTrainer) -> None:
    logs = getattr(trainer, COMPLETION_LOGS)
    for key in ("images", "prompt", "completion", "advantages"):
        logs[key].clear()
    logs["rewards"].clear()
    logs["extra"].clear()


def _plain(value):
    """``value`` with anything torch.load(weights_only=True) would refuse made plain: numpy and one-element
    torch scalars by their item(), subclasses of str/int/float by their base type, any other object by its str()."""
    if value is None or type(value) in (str, bool, int, float):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return _plain(value.item())
    for base in (bool, int, float, str):
        if isinstance(value, base):
            return base(value)
    return str(value)


def _add_behaviour_logps(trainer: GRPOTrainer, batch: dict, capture: BehaviourCapture | MultiTurnCapture) -> None:
    if getattr(trainer.args, "max_staleness", None) == 0:  # the PS's current weights are the behaviour weights
        return
    logps = capture.per_token_logps(batch)
    if logps is not None:
        batch["old_per_token_logps"] = logps
        return
    log_once(log, f"[gen] behaviour log-probs from a second forward pass: {capture.why_not}")
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logps, _, _ = getattr(trainer, BEHAVIOUR_LOGPS)(
        trainer.model, ids, mask, batch["completion_ids"].size(1),
        batch_size=trainer.args.per_device_train_batch_size)
    batch["old_per_token_logps"] = logps
