"""Generation and scoring on a worker, by TRL's own code path.

A worker holds a GRPOTrainer that never trains: ``_generate_and_score_completions`` on a
job's rows generates, scores with the reward functions and computes advantages exactly
as TRL does. TRL only computes the behaviour log-probs (``old_per_token_logps``) when
generation and optimisation steps are misaligned; here every result may be trained on
by newer weights, so the worker supplies them, from the weights it generated with. The
PS weights each token by the truncated ratio current/behaviour (ps/offpolicy.py): stale
samples are corrected, not ignored.

The behaviour log-probs are captured during generation (BehaviourCapture): generate's
own forward passes already compute every sampled token's logits, so the second forward
pass over every completion (TRL's ``_get_per_token_logps_and_entropies``) only runs
where capture does not apply. Except in synchronous mode (``max_staleness == 0``):
there the PS trains with the weights the worker generated with, so without capture the
key is left out and the PS uses its own current log-probs.

Generation and scoring are timed apart by wrapping TRL's ``_generate`` for the call.

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
import statistics
import time
import traceback
import zlib

import numpy as np
import torch
from trl import GRPOTrainer
from trl.trainer.utils import disable_dropout_in_model

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.events import EventLog

GENERATE_AND_SCORE = "_generate_and_score_completions"
BEHAVIOUR_LOGPS = "_get_per_token_logps_and_entropies"
GENERATE = "_generate"
CALCULATE_REWARDS = "_calculate_rewards"  # its loop variable reward_func_name names the function being called
COMPLETION_LOGS = "_logs"  # TRL's completions table: prompt, completion, rewards (per function), advantages, extra

log = logging.getLogger("asyncgrpo.worker")


def build_trainer(cfg: AsyncGRPOConfig, model, tokenizer, reward_funcs, dataset) -> GRPOTrainer:
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
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=cfg.peft_config())
    trainer.model.train()  # TRL's "train" mode: train-time num_generations and metric names
    # ... but no dropout (LoRA's included): the behaviour log-probs must be those of the policy the PS trains,
    # not of one random dropout mask per sample.
    disable_dropout_in_model(trainer.model)
    return trainer


def job_seed(seed: int, job_id: str) -> int:
    """The sampling seed of one job: the run's seed and the job id, whichever worker runs it."""
    return (seed * 1_000_003 + zlib.crc32(job_id.encode())) % 2**63


def generate_and_score(trainer: GRPOTrainer, rows: list[dict], events: EventLog, *, seed: int, ps_step: int = 0,
                       **job_fields) -> tuple[dict, dict]:
    """One job: (TRL's result dict on the CPU with behaviour log-probs, this job's metrics).

    The behaviour log-probs are left out only in synchronous mode when they could not be
    captured during generation (see the module's docstring).

    Sampling is seeded with ``seed`` (see job_seed): every worker's trainer was seeded alike
    at start-up, and without this their samples would run in lockstep. Emits
    generate_start/end and score_start/end events carrying ``job_fields`` (job_id, ...).

    ``ps_step`` is the PS's step when the job was thrown: reward functions see it as
    ``trainer_state.global_step``, as they would in TRL (a worker never trains)."""
    torch.manual_seed(seed)
    trainer.state.global_step = ps_step
    trainer._metrics["train"].clear()  # metrics of this job only, not cumulative
    _clear_completion_logs(trainer)  # and its completions table rows only
    generate = getattr(trainer, GENERATE)
    generated_at = []
    capture = BehaviourCapture(trainer)

    def timed_generate(*args, **kwargs):
        with events.span("generate", **job_fields), capture.watching_generate():
            out = generate(*args, **kwargs)
        generated_at.append(time.monotonic())
        events.emit("score_start", **job_fields)
        return out

    setattr(trainer, GENERATE, timed_generate)
    try:
        # The PS's forward passes run under the trainer's mixed precision (accelerate wraps the model it
        # prepares for training); a worker never trains, so its model is never prepared: the same autocast here,
        # or a float32 base meets TRL's bfloat16 QLoRA adapter in one matmul and every generation fails.
        with torch.no_grad(), trainer.accelerator.autocast():
            batch = getattr(trainer, GENERATE_AND_SCORE)(rows)
            if "old_per_token_logps" not in batch:  # TRL computes them only when steps misalign
                _add_behaviour_logps(trainer, batch, capture)
    finally:
        delattr(trainer, GENERATE)  # back to the class's method
    if generated_at:
        events.emit("score_end", dur_ms=(time.monotonic() - generated_at[0]) * 1e3, **job_fields)
    metrics = {name: statistics.fmean(values) for name, values in trainer._metrics["train"].items() if values}
    trainer._metrics["train"].clear()
    on_cpu = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return on_cpu, metrics


def error_record(err: BaseException) -> dict:
    """What a job that raised tells the PS (asyncgrpo.jobqueue.describe_error): the exception's type and
    message, and where: in generation, or in scoring, naming the reward function TRL was calling (the
    ``reward_func_name`` of TRL's ``_calculate_rewards`` frame, ``func_name`` on its async path), also when
    TRL itself raised about that function's output (a wrong number of rewards)."""
    reward_function, stage = None, "scoring"
    calculate_rewards = inspect.unwrap(getattr(GRPOTrainer, CALCULATE_REWARDS)).__code__  # TRL profiles it
    generate = inspect.unwrap(getattr(GRPOTrainer, GENERATE)).__code__
    for frame, _ in traceback.walk_tb(err.__traceback__):
        code = frame.f_code
        if code is generate:
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


def _add_behaviour_logps(trainer: GRPOTrainer, batch: dict, capture: BehaviourCapture) -> None:
    logps = capture.per_token_logps(batch)
    if logps is not None:
        batch["old_per_token_logps"] = logps  # free, so always sent, synchronous mode included
        return
    if getattr(trainer.args, "max_staleness", None) == 0:
        _log_once(f"[gen] behaviour log-probs not sent: {capture.why_not}; synchronous mode, the PS's current "
                  f"weights are the behaviour weights")
        return
    _log_once(f"[gen] behaviour log-probs from a second forward pass: {capture.why_not}")
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logps, _, _ = getattr(trainer, BEHAVIOUR_LOGPS)(
        trainer.model, ids, mask, batch["completion_ids"].size(1),
        batch_size=trainer.args.per_device_train_batch_size)
    batch["old_per_token_logps"] = logps


_logged: set[str] = set()


def _log_once(line: str) -> None:
    """Why capture did not apply is a property of the run's configuration: say it once per process."""
    if line not in _logged:
        _logged.add(line)
        log.info(line)


class BehaviourCapture:
    """The log-prob of each sampled token under the weights that sampled it, read off generate's own forwards.

    TRL recomputes behaviour log-probs as ``log_softmax(logits / temperature)`` at each
    completion token, from the model's logits before any logits processor (no top-k, top-p
    or repetition penalty), and the PS's loss compares them with its own computed the same
    way. The logits the decoding loop feeds to its processors are those same raw logits, so
    the quantity is captured here without a second forward pass.

    While TRL's ``_generate`` runs (``watching_generate``), the model TRL generates with
    gets ``generate`` wrapped as an instance attribute, and while that runs, a forward hook.
    Each decoding forward's last-position logits are kept until the next forward, whose
    input_ids end with the token they sampled; the last token's come from generate's output.
    That keeps one (batch, vocab) row set alive, not one per step.

    Anything unexpected (generate called twice or not at all, decoding forwards that do not
    match the generated tokens one to one, rows that do not line up with TRL's batch) leaves
    ``per_token_logps`` returning None, with the reason in ``why_not``; the caller then
    falls back to the forward pass. Configurations known not to generate through a single
    ``model.generate`` call are not watched at all.
    """

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer
        self.temperature = trainer.args.temperature  # what TRL's fused LM head divides by
        self.why_not: str | None = self._unsupported(trainer)
        self.generate_calls = 0
        self.logps: torch.Tensor | None = None  # (B, new tokens)
        self.tokens: torch.Tensor | None = None  # (B, new tokens), the tokens they were gathered at
        # During one generate call: the previous forward's last-position logits, and what was gathered so far.
        self._pending: torch.Tensor | None = None
        self._step_logps: list[torch.Tensor] = []
        self._step_tokens: list[torch.Tensor] = []

    @staticmethod
    def _unsupported(trainer: GRPOTrainer) -> str | None:
        # TRL's other generation paths do not call model.generate once over the batch (or return
        # completions spliced with tool output); beam search feeds batch x beams rows to the model.
        if trainer.use_vllm:
            return "use_vllm"
        if trainer.use_transformers_continuous_batching:
            return "use_transformers_continuous_batching"
        if trainer.rollout_func is not None:
            return "rollout_func"
        if trainer.tools:
            return "tools"
        if (getattr(trainer.generation_config, "num_beams", None) or 1) > 1:  # None: transformers' default, 1
            return "num_beams > 1"
        return None

    # ------------------------------------------------------------------ during generation

    @contextlib.contextmanager
    def watching_generate(self):
        """For the span of TRL's ``_generate``: the generating model's ``generate`` is wrapped."""
        if self.why_not is not None:  # not a single model.generate call: nothing to watch
            yield
            return
        model = self._model()
        own = model.__dict__.get("generate")  # an instance attribute someone else set, if any
        model.generate = functools.partial(self._generate, model, model.generate)
        try:
            yield
        finally:
            if own is None:
                del model.generate  # back to the class's method
            else:
                model.generate = own

    def _generate(self, model, original, *args, **kwargs):
        self.generate_calls += 1
        if self.generate_calls > 1:
            self.why_not = self.why_not or "generate was called more than once in one job"
        if self.why_not is not None:
            return original(*args, **kwargs)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(input_ids, torch.Tensor):
            self.why_not = "generate was called without input_ids"
            return original(*args, **kwargs)
        handle = model.register_forward_hook(self._on_forward, with_kwargs=True)
        try:
            out = original(*args, **kwargs)
        finally:
            handle.remove()
        self._finish(out, input_ids.size(1))
        return out

    def _on_forward(self, _module, args, kwargs, output):
        if self.why_not is not None:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        logits = getattr(output, "logits", None)
        if not isinstance(input_ids, torch.Tensor) or not isinstance(logits, torch.Tensor):
            self.why_not = "a forward pass inside generate had no input_ids or no logits"
            return
        if self._pending is not None:
            # This forward's last input token is the one sampled from the previous forward's logits.
            if input_ids.size(0) != self._pending.size(0):
                self.why_not = "the decoding forwards' batch size changed"
                return
            self._gather(input_ids[:, -1])
        # A copy (in float32, as generate samples from): the output, and its large first-step logits, go away.
        self._pending = logits[:, -1, :].to(dtype=torch.float32, copy=True)

    def _gather(self, tokens: torch.Tensor) -> None:
        tokens = tokens.to(self._pending.device)
        # What TRL's fused LM head computes, in float32 (trl's selective_log_softmax is the same sum, ~4x slower
        # per decoding step on small batches: it checks for its Triton kernel and loops over rows).
        logps = torch.log_softmax(self._pending / self.temperature, dim=-1).gather(1, tokens[:, None])[:, 0]
        self._step_logps.append(logps)
        self._step_tokens.append(tokens)
        self._pending = None

    def _finish(self, out, prompt_length: int) -> None:
        if self.why_not is not None:
            return
        if not isinstance(out, torch.Tensor):
            self.why_not = "generate did not return a tensor of token ids"
            return
        new_tokens = out[:, prompt_length:]
        steps = len(self._step_logps) + (self._pending is not None)
        if steps != new_tokens.size(1) or self._pending is None or self._pending.size(0) != out.size(0):
            # e.g. chunked prefill, assisted decoding, deferred stop checks, or rows other than the output's
            self.why_not = "generate's forward passes do not match the generated tokens one to one"
            return
        self._gather(out[:, -1])
        tokens = torch.stack(self._step_tokens, dim=1)
        if not torch.equal(tokens, new_tokens.to(tokens.device)):
            self.why_not = "the tokens seen by generate's forward passes are not the generated ones"
            return
        self.logps, self.tokens = torch.stack(self._step_logps, dim=1), tokens
        self._step_logps, self._step_tokens = [], []

    def _model(self) -> torch.nn.Module:
        # The model TRL's transformers path generates with (unwrap_model_for_generation's).
        return self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)

    # ------------------------------------------------------------------ after scoring

    def per_token_logps(self, batch: dict) -> torch.Tensor | None:
        """The captured log-probs shaped as TRL's ``old_per_token_logps`` for ``batch``, or None (see why_not)."""
        if self.why_not is None and self.generate_calls == 0:
            self.why_not = "generate was not called"
        if self.why_not is not None:
            return None
        completion_ids, mask = batch["completion_ids"], batch["completion_mask"].bool()
        if completion_ids.size(0) != self.logps.size(0):
            self.why_not = "TRL's batch does not have one row per generated sequence"
            return None
        # TRL cuts each completion after its EOS and right-pads to the longest (or to pad_to_multiple_of).
        width, captured = completion_ids.size(1), self.logps.size(1)
        logps = self.logps.to(completion_ids.device)[:, :width]
        tokens = self.tokens.to(completion_ids.device)[:, :width]
        if width > captured:  # padding only: beyond every completion, so masked out
            logps = torch.nn.functional.pad(logps, (0, width - captured))
            tokens = torch.nn.functional.pad(tokens, (0, width - captured))
        # TRL keeps the generate call's row order; were that to change, this would notice.
        if not bool(((tokens == completion_ids) | ~mask).all()):
            self.why_not = "TRL's completions are not the generated rows in order"
            return None
        # Masked-out positions as TRL's forward pass gives them: 0.
        return torch.where(mask, logps, torch.zeros_like(logps))

