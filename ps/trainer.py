"""The parameter server's trainer: TRL's GRPOTrainer, fed by the job pipeline instead of generating.

Only TRL internals are overridden here; the queue side is ps/pipeline.py.

- ``_generate_and_score_completions`` in training mode takes the next result a worker
  produced with TRL's own code (worker/generate.py) from the pipeline. TRL's
  ``_prepare_inputs`` (splitting, buffering) and loss run unchanged.
- The off-policy correction (ps/offpolicy.py) weights each token's advantage by the
  truncated importance ratio current/behaviour. The worker's behaviour log-probs reach TRL
  as ``sampling_per_token_logps`` (so TRL's ``off_policy_mask_threshold`` compares against
  them). The proximal policy of decoupled PPO is the policy when the result was taken: for
  a result that trains one optimizer step that is the current one, so TRL's ratio against
  it is 1 and no extra forward pass is needed; a result that trains several steps
  (``--num_iterations``, ``--steps_per_generation``) gets the proximal log-probs from one
  forward pass when it is taken, as TRL's ``old_per_token_logps``, and TRL's clipped ratio
  current/proximal governs its later steps. With ``--off_policy_correction none`` the
  behaviour log-probs are TRL's ``old_per_token_logps`` instead: TRL's loss clips the ratio
  current/behaviour.
- With ``--log_completions`` TRL's completions table is filled from the rows each result
  carries (the worker's TRL logged them while scoring), so TRL's ``log`` prints it and writes
  its parquet files as it would after generating.
- After each optimizer step the weights are published, ``global_step.txt`` is written, and
  each logged step appends one line to ``RUN/metrics.jsonl``; a step's staleness is its own
  (step - 1 - the weights version of the result it trains). Checkpoints carry the
  pipeline's durable state (ledger, producer journal, rows owed a re-throw) and are saved
  only between batches: a save that falls inside a batch waits for the batch's last step (the
  final save excepted), so the ledger never holds a batch half trained and resume is exact.
- Several processes (``--ps_processes``, started by torchrun / accelerate launch): the first rank
  alone is the queue client (pipeline, events, metrics.jsonl) and publishes weights (under FSDP2 the
  ranks first gather each tensor whole together: adapter.gather_full_tensors); it
  broadcasts each batch (ps/batches.py, TRL's own vLLM-server pattern) and every rank trains on its
  ``process_slice`` with the batch's ``num_items_in_batch``, so K ranks make the update one
  rank would. A checkpoint's ledger is written once every rank has saved its part.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import rotate_checkpoints
from trl import GRPOTrainer

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue import JobQueue
from asyncgrpo.jobqueue.names import depth_line
from asyncgrpo.run import RunDir, metrics
from asyncgrpo.run.checkpoints import (
    is_complete,
    name_local_base_in_card,
    read_ledger,
    write_ledger,
)
from asyncgrpo.user_code import RolloutHooks
from asyncgrpo.weights import make_publisher
from asyncgrpo.weights.adapter import gather_full_tensors
from ps.batches import BatchSource, BroadcastBatches, PipelineBatches
from ps.flag_changes import recorded_flags, say_if_the_schedule_changed
from ps.learning_signal import LearningSignal, finite
from ps.offpolicy import TokenWeighting
from ps.pipeline import BatchInTraining, JobPipeline, PipelineError
from ps.step_record import StepRecord

log = logging.getLogger("asyncgrpo.ps")
# The [train] line of a step the terminal does not show: in the PS's log at this level ("STEP"), which launch.sh's
# terminal filter leaves out. The terminal shows one step in every max_steps / TERMINAL_STEP_LINES (and the first and
# last): a few dozen lines a run, not a thousand; metrics.jsonl and the log keep every step.
STEP = 15
TERMINAL_STEP_LINES = 40
logging.addLevelName(STEP, "STEP")
log.setLevel(min(log.getEffectiveLevel(), STEP))
LOG_HISTORY_KEPT = 1000  # the newest entries of trainer.state.log_history (see log())


# What a relaunch's flags set in each of the optimizer's parameter groups (the learning rate goes by the schedule).
RESTORED_HYPERPARAMETERS = ("weight_decay", "betas", "eps")


class AsyncGRPOTrainer(GRPOTrainer):
    def __init__(self, cfg: AsyncGRPOConfig, run: RunDir, model, tokenizer, reward_funcs, dataset, eval_dataset=None,
                 hooks: RolloutHooks | None = None, stop_at_boundary: threading.Event | None = None,
                 interrupted: threading.Event | None = None, batches: BatchSource | None = None):
        # Evaluation (--eval_strategy) is TRL's own, on the PS's model (see _generate_and_score_completions).
        # With --use_peft TRL wraps the model (get_peft_model): the PS trains, checkpoints and publishes only
        # the adapter; with beta > 0 the reference is the base with the adapter disabled (no second model).
        # The workers' rollout hooks (tools, environment): the same reward sources and metric names, TRL's checks
        # of the chat template up front, and TRL's own multi-turn evaluation.
        super().__init__(model=model, reward_funcs=reward_funcs, args=cfg, train_dataset=dataset,
                         eval_dataset=eval_dataset, processing_class=tokenizer, peft_config=cfg.peft_config(),
                         **(hooks or RolloutHooks()).trainer_kwargs())
        self.cfg, self.run = cfg, run
        self.is_queue_client = self.accelerator.is_main_process  # the other ranks only train
        if self.is_queue_client:
            self.events = EventLog(run.logs, "ps", "ps", str(self.accelerator.device))
            self.queue = JobQueue(run, events=self.events, max_payload_bytes=cfg.max_payload_bytes)
            self.pipeline = JobPipeline(cfg, run, self.queue, dataset, pad_token_id=self._tokenizer.pad_token_id,
                                        stop_at_boundary=stop_at_boundary, interrupted=interrupted)
            # The model's device may not be its training device yet (FSDP moves it when training starts).
            self.publisher = make_publisher(run, self.model, cfg.weight_transport, device=self.accelerator.device,
                                            dtype=cfg.worker_dtype)
            # Workers of other hosts behind a delta bad on disk wait for an anchor, and the PS waiting for their
            # results publishes none: its last version goes out again as one (the safetensors transport).
            self.pipeline.while_waiting = getattr(self.publisher, "while_trainer_waits", None)
        # Where the batches come from (ps/batches.py): ``batches`` stands in for the pipeline in tests.
        self.batches: BatchSource = batches or (
            PipelineBatches(self.pipeline, self.events, broadcast=self.accelerator.num_processes > 1)
            if self.is_queue_client else BroadcastBatches())
        self.weighting = TokenWeighting(cfg.off_policy_correction, cfg.off_policy_cap)
        self._resume_checkpoint: str | None = None
        self.step_record = StepRecord(dynamic_sampling=cfg.dynamic_sampling)  # since the last logged step
        self._save_due_after_batch = self._evaluation_due_after_batch = False
        self.signal = LearningSignal()  # steps without a reward, or whose rewards do not spread
        self.add_callback(_PipelineCallback(self))

    # ------------------------------------------------------------------ lifecycle

    def train(self, resume_from_checkpoint: str | None = None, **kwargs):
        self._resume_checkpoint = resume_from_checkpoint
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            if self.is_queue_client:
                self.pipeline.stop()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer's and the schedule's state from ``checkpoint``, under this launch's hyperparameters:
        torch's load_state_dict brings back the ones the checkpoint was trained with (its learning rate, weight
        decay, betas), and a relaunch that said it changed them would have trained on with the old ones. The
        learning rate of the next step is the schedule's at that step, of the new base rate (the schedule transformers
        rebuilt over this launch's --max_steps)."""
        fresh = [{k: group[k] for k in RESTORED_HYPERPARAMETERS if k in group} for group in self.optimizer.param_groups]
        fresh_base = list(getattr(self.lr_scheduler, "base_lrs", []))
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or len(fresh_base) != len(fresh):
            return
        scheduler = self.lr_scheduler
        factors = getattr(scheduler, "lr_lambdas", None)  # transformers' schedules, rebuilt for this launch's steps
        for i, (group, hyper, new, old) in enumerate(zip(self.optimizer.param_groups, fresh, fresh_base,
                                                         scheduler.base_lrs, strict=True)):
            group.update(hyper)
            if factors:  # (a finished run's old schedule ends at 0: a longer relaunch's goes on from its own)
                group["lr"] = new * factors[i](scheduler.last_epoch)
            else:  # the old schedule's factor at this step, of the new base rate
                group["lr"] = group["lr"] * new / old if old else new
            if "initial_lr" in group:
                group["initial_lr"] = new
        scheduler.base_lrs = fresh_base
        # What transformers logs as the step's learning rate (torch's step sets it so, from the groups)
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _start_pipeline(self) -> None:
        """Called once model, optimizer and step are restored: adopt the queue, then feed it."""
        self._publish_weights()
        if not self.is_queue_client:
            return
        state = read_ledger(self._resume_checkpoint).pipeline_state if self._resume_checkpoint else None
        if self._resume_checkpoint:
            say_if_the_schedule_changed(self._resume_checkpoint, self.state, self.lr_scheduler,
                                        self.args.lr_scheduler_type)
        self.step_record = StepRecord(self._forget_metrics_after(self.state.global_step),
                                      dynamic_sampling=self.cfg.dynamic_sampling)
        last = metrics.last_line(self.run.metrics_file)
        self.signal = LearningSignal.resumed(self.state.global_step,
                                             last if last and last.get("step") == self.state.global_step else None)
        self.pipeline.start(state, published_version=self.state.global_step)

    def _forget_metrics_after(self, step: int) -> int:
        """metrics.jsonl keeps each step once: lines of steps after the checkpoint we resume from describe
        training lost with the old PS, and those steps are trained again. Returns the groups dynamic sampling
        dropped in the lines kept (where the running total each line carries goes on from)."""
        truncated = metrics.truncate_after(self.run.metrics_file, step)
        torn = truncated.unreadable  # a line cut short by a crash (or written over by hand)
        if truncated.removed or torn:
            log.info("[train] metrics.jsonl: %d line(s) of steps %s removed (they are trained again)%s",
                     truncated.removed, f"after {step}" if step else "of a run without a checkpoint",
                     f", {torn} unreadable line(s) removed" if torn else "")
        return sum(line.get("groups_dropped") or 0 for line in truncated.kept)

    def finish(self) -> None:
        """End of training: what is left in queue/ is archived 'unused'; buffers freed."""
        if not self.is_queue_client:
            return
        self.pipeline.finish()
        self.close()

    def close(self) -> None:
        """Frees the weight buffers (/dev/shm, GPU) and closes the events file; the PS calls it however it
        ends (idempotent)."""
        if self.is_queue_client:
            self.pipeline.stop()
            self.publisher.close()
            self.events.close()

    def evaluate(self, eval_dataset=None, *args, **kwargs):
        """TRL's evaluation (--eval_strategy), on the PS's model, as a span of its own in the timeline: the report
        counts it apart from training (queue_tools/report.py). Said on the terminal as it starts: training stops
        until it ends, which on a CPU may be minutes."""
        if not self.is_queue_client:
            return super().evaluate(eval_dataset, *args, **kwargs)
        data = self.eval_dataset if eval_dataset is None else eval_dataset
        rows = f" {len(data)} prompts" if hasattr(data, "__len__") and not isinstance(data, (str, dict)) else ""
        log.info("[eval] step=%d evaluating%s on the parameter server's model: training resumes after it",
                 self.state.global_step, rows)
        with self.events.span("eval", step=self.state.global_step):
            return super().evaluate(eval_dataset, *args, **kwargs)

    # ------------------------------------------------------------------ the replaced TRL internals

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation generates here, as TRL does
            return super()._generate_and_score_completions(inputs)
        started = time.monotonic()
        # StopRequested: every rank leaves the training loop here, and saves (save_checkpoint_at_stop)
        taken = self.batches.take(self.state.global_step)
        self.step_record.waited(time.monotonic() - started)
        batch = taken.tensors
        # Tokens trained on, counted as TRL counts them: prompt and completion tokens, once per generation batch.
        self.state.num_input_tokens_seen += int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
        self._add_batch_metrics()
        self.step_record.dropped(self.batch_in_training.groups_dropped)  # (counted on the batch's first step)
        if self.log_completions and self.is_queue_client:
            self._add_completion_logs(taken.logs)
        batch = self._process_slice(batch)
        behaviour = batch.pop("old_per_token_logps", None)
        if behaviour is not None:
            batch[self.weighting.input_key] = behaviour
        device = self.accelerator.device
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if self.cfg.steps_per_job > 1 and "old_per_token_logps" not in batch:
            batch["old_per_token_logps"] = self._proximal_logps(batch)
        return batch

    @property
    def batch_in_training(self) -> BatchInTraining | None:
        """The batch whose steps are being trained (ps/batches.py: alike on every rank)."""
        return self.batches.in_training

    def _process_slice(self, batch: dict) -> dict:
        """This rank's rows of the batch, as TRL's process_slice; num_items_in_batch stays the batch's token count
        (TRL's loss divides every rank's sum by the global count)."""
        if self.accelerator.num_processes == 1:
            return batch
        rows = batch["advantages"].size(0)
        n = rows // self.accelerator.num_processes
        part = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
        return {k: v[part] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.size(0) == rows else v
                for k, v in batch.items()}

    def _add_batch_metrics(self) -> None:
        """The workers' TRL metrics (reward, ...) of the batch in training, once per step it trains; num_tokens
        is the PS's own count (each worker's counts only the jobs it generated)."""
        for name, value in self.batch_in_training.metrics.items():
            if name != "num_tokens":
                self._metrics["train"][name].append(value)
        self._metrics["train"]["num_tokens"] = [self.state.num_input_tokens_seen]

    def _add_completion_logs(self, logs: dict | None) -> None:
        """The result's rows of TRL's completions table, where TRL's own generation would have put them."""
        if not logs:
            log.warning("[train] --log_completions: the result carries no completions (was its worker started "
                        "without --log_completions?)")
            return
        self._logs["prompt"].extend(logs.get("prompt", []))
        self._logs["completion"].extend(logs.get("completion", []))
        for name, values in logs.get("rewards", {}).items():
            self._logs["rewards"][name].extend(values)
        self._logs["advantages"].extend(logs.get("advantages", []))
        for column, values in logs.get("extra", {}).items():
            self._logs["extra"][column].extend(values)

    def _proximal_logps(self, batch: dict) -> torch.Tensor:
        """Log-probs under the weights the batch is taken with: the proximal policy of its later steps."""
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, batch["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size)
        return logps

    def _compute_loss(self, model, inputs):
        if not self.model.training:
            return super()._compute_loss(model, inputs)
        with self.weighting.armed(inputs) as weighted_inputs:
            loss = super()._compute_loss(model, weighted_inputs)
        for name, value in self.weighting.metrics().items():
            self._metrics["train"][name].append(value)
        return loss

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        self.weighting.on_policy_logps(logps)  # TRL's loss forward: the proximal log-probs are now known
        return logps, entropies, aux_loss

    # ------------------------------------------------------------------ after each step

    def on_optimizer_step_begin(self) -> None:
        self.step_record.step_started()
        if self.is_queue_client:
            self.events.emit("train_step_start", step=self.state.global_step + 1)
        if self.batch_in_training is not None:  # a later step of the same batch: no result is taken
            self._add_batch_metrics()

    def on_optimizer_step_end(self) -> None:
        step = self.state.global_step
        trained = self.step_record.step_trained(step, self.batch_in_training.parts)
        if self.is_queue_client:
            self.events.emit("train_step_end", step=step, **trained)
        self._publish_weights()
        if self.is_queue_client:
            self.run.write_global_step(step)
        self.batches.step_trained(step)

    def hold_save_until_batch_ends(self, control) -> None:
        """Checkpoints only between batches: a save inside a batch moves to its last step (not the final save), and
        so does an evaluation, since with ``--save_strategy best`` an evaluation decides a save."""
        inside_a_batch = self.batch_in_training is not None  # known on every rank: they all save, or none
        held = inside_a_batch and self.state.global_step < self.state.max_steps
        if held and (control.should_save or control.should_evaluate):
            log.info("[train] step=%d is inside a batch: its %s when the batch's last step has trained",
                     self.state.global_step, "checkpoint is saved" if control.should_save else "evaluation runs")
            self._save_due_after_batch |= control.should_save
            self._evaluation_due_after_batch |= control.should_evaluate
            control.should_save = control.should_evaluate = False
        elif not inside_a_batch:
            control.should_save |= self._save_due_after_batch
            control.should_evaluate |= self._evaluation_due_after_batch
            self._save_due_after_batch = self._evaluation_due_after_batch = False

    def save_checkpoint_at_stop(self) -> str | None:
        """After StopRequested (every rank): the checkpoint of the last trained step, unless it is saved already
        or nothing was trained. Between batches, so the ledger holds exactly the results trained into these
        weights. The folder saved, or None."""
        step = self.state.global_step
        folder = Path(self.args.output_dir) / f"checkpoint-{step}"
        if step == 0 or is_complete(folder):
            return None
        self._save_checkpoint(self.model, trial=None)
        return str(folder)

    def _publish_weights(self) -> None:
        """On every rank: under FSDP2 each holds a shard, and they gather the whole tensors together for the
        first rank to publish."""
        step = self.state.global_step
        started = time.monotonic()
        whole = gather_full_tensors(self.model, keep=self.is_queue_client) if self.is_fsdp_enabled else None
        if not self.is_queue_client:
            return
        self.publisher.publish(version=step, step=step, tensors=whole)
        publish_ms = (time.monotonic() - started) * 1e3
        self.events.emit("weights_published", weights_version=step, dur_ms=publish_ms,
                         bytes=self.publisher.published_bytes)
        log.debug("[weights] published version=%d publish_ms=%.1f", step, publish_ms)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        is_step_log = self.model.training and "loss" in logs and self.step_record.has_trained
        if is_step_log:  # asyncgrpo's own metrics go to report_to integrations with TRL's
            logs.update(self.step_record.trl_logs())
        super().log(logs, start_time)  # TRL averages its metrics (reward, ...) into logs
        # transformers keeps every log in log_history for the life of the process (1.5 KB a step with the demo's
        # --logging_steps 1) and rewrites all of it into each checkpoint's trainer_state.json: the PS would grow
        # without bound. metrics.jsonl and the report_to integrations keep every step.
        del self.state.log_history[:-LOG_HISTORY_KEPT]
        if "eval_loss" in logs:  # TRL's evaluation, on the PS's model (--eval_strategy)
            log.info("[eval] step=%d reward=%s loss=%.4f", self.state.global_step,
                     _fmt(finite(logs.get("eval_reward"))), logs["eval_loss"])
            if self.is_queue_client:
                metrics.append(self.run.metrics_file, metrics.eval_line(self.state.global_step, logs))
        if not is_step_log or not self.is_queue_client:
            return
        # (reward NaN: every reward function returned None or NaN for every row)
        all_masked = self.args.mask_truncated_completions and (logs.get("completions/clipped_ratio") or 0) >= 1.0
        self.signal.observe(self.state.global_step, finite(logs.get("reward")), logs.get("frac_reward_zero_std"),
                            all_masked)
        line = self.step_record.line(self.state.global_step, logs, self.signal,
                                     self.pipeline.producer.prompts_skipped, self.queue.counts())
        metrics.append(self.run.metrics_file, line)
        self._show_progress(line)
        if self.signal.stop is not None:
            raise PipelineError(self.signal.stop)

    def _show_progress(self, line: metrics.StepMetrics) -> None:
        dropped = self.pipeline.failed.prompts  # jobs that failed on every attempt: never trained on
        state = getattr(self, "state", None)
        max_steps = getattr(state, "max_steps", 0) or 0
        logged = max(1, int(getattr(state, "logging_steps", 1) or 1))  # (only the steps logged have a line)
        every = logged * max(1, round(max_steps / (logged * TERMINAL_STEP_LINES)))
        shown = line.step % every == 0 or line.step == 1 or line.step >= max_steps
        # (reward None: every reward function returned None for every row of the step, which TRL allows)
        log.log(logging.INFO if shown else STEP, "[train] %s",
                metrics.step_words(dataclasses.asdict(line), depth_line(line.queue_depth), dropped))
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.set_postfix(reward=_fmt(line.reward),
                                                  staleness=f"{line.staleness_mean:.1f}",
                                                  wait_ms=f"{line.trainer_wait_s * 1e3:.0f}", refresh=False)

    def create_model_card(self, *args, **kwargs):
        super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero():
            name_local_base_in_card(self.args.output_dir, getattr(self.model.config, "_name_or_path", None))

    def _save_checkpoint(self, model, trial):
        # The ledger goes last: it marks the checkpoint complete (see asyncgrpo/run/checkpoints.py). transformers
        # deletes older checkpoints (save_total_limit) inside _save_checkpoint, before the ledger would be written:
        # a PS killed in between would leave no complete checkpoint. So older ones are deleted after the ledger.
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every rank's part (its RNG state, ...) is on disk
        if not self.is_queue_client:
            return
        run_dir = self._get_output_dir(trial=trial)
        final = self.state.global_step >= self.state.max_steps
        state = {**self.pipeline.state_dict(final), "flags": recorded_flags(self.cfg)}
        if final:
            self.pipeline.consume_leftover()  # archived as the ledger counts it, before the ledger
        write_ledger(os.path.join(run_dir, f"checkpoint-{self.state.global_step}"), self.state.global_step, state)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit, use_mtime=True,
                               best_model_checkpoint=self.state.best_model_checkpoint)


class _PipelineCallback(TrainerCallback):
    def __init__(self, trainer: AsyncGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._start_pipeline()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.on_optimizer_step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        # Every run's terminal shows its first and last steps and metrics.jsonl has them, whatever --logging_steps
        # (TRL's default 10 would leave a short run without one line).
        if args.logging_strategy != "no" and (state.global_step == 1 or state.global_step >= state.max_steps):
            control.should_log = True
        self.trainer.on_optimizer_step_end()
        self.trainer.hold_save_until_batch_ends(control)  # after DefaultFlowCallback decided should_save

    def on_epoch_end(self, args, state, control, **kwargs):
        self.trainer.hold_save_until_batch_ends(control)  # (epoch strategies save and evaluate from here)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"
