"""A run relaunched with other flags than its checkpoint was trained with.

Each checkpoint's ledger records the flags that shape training and generation (``recorded_flags``). On resume each
change is said in one line, from and to, and what it means for the jobs already thrown; a change those jobs cannot
take is refused before training starts. A job's rows are drawn for the generation batch of the run that threw it:
each prompt repeated ``num_generations`` times, one group a prompt. Under another group size (or another number of
rows a job) its rows would be regrouped across prompts and its advantages computed against another prompt's
completions, silently: so ``num_generations``, ``per_device_train_batch_size``, ``steps_per_generation`` and
``ps_processes`` cannot change within a run, nor what a LoRA adapter is made of (``ADAPTER_FLAGS``). The other
generation flags apply from the relaunch on, to the jobs already thrown too (a worker generates a job with its own
flags, the PS's); the training flags from the next step on; the queue's (attempts, lease) to every job from the
relaunch on; any other flag from now on.

(``max_steps`` is not among them: a longer or shorter run rebuilds the learning-rate schedule, which
``say_if_the_schedule_changed`` says. Nor are credentials, which no file of the run keeps, nor where the run is.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from asyncgrpo.config import GENERATION_FLAGS, AsyncGRPOConfig, ConfigError

log = logging.getLogger("asyncgrpo.ps")

ROW_LAYOUT_FLAGS = ("num_generations", "per_device_train_batch_size", "steps_per_generation", "ps_processes")
# What a LoRA adapter is made of: its checkpoints hold one of that shape and scale (another --lora_alpha would scale
# the trained weights anew, another --lora_r not load).
ADAPTER_FLAGS = ("use_peft", "lora_r", "lora_alpha", "lora_target_modules", "lora_target_parameters",
                 "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora")
TRAINING_FLAGS = ("learning_rate", "lr_scheduler_type", "weight_decay", "max_grad_norm", "gradient_accumulation_steps",
                  "num_iterations", "loss_type", "epsilon", "epsilon_high", "max_staleness", "off_policy_correction",
                  "off_policy_cap", "dynamic_sampling")
INPUT_FLAGS = ("model_name_or_path", "dataset_name", "reward_funcs")  # what the jobs are drawn from and scored by
QUEUE_FLAGS = ("max_attempts", "lease_s")  # what recovery and a job's failures go by
# Where the run is, not how it trains (a run folder may move; output_dir is the PS's RUN/checkpoints, final_model_dir
# a copy of the --output_dir given), max_steps, and credentials.
NOT_RECORDED = ("run_dir", "output_dir", "final_model_dir", "max_steps", "hub_token")
CREDENTIAL_KEYS = ("token", "hub_token", "use_auth_token")  # in a flag's mapping (--model_init_kwargs '{"token": ...}')


def recorded_flags(cfg: AsyncGRPOConfig) -> dict:
    """What a checkpoint's ledger records of ``cfg``: every flag, as JSON values."""
    flags = {f.name: getattr(cfg, f.name, None) for f in dataclasses.fields(cfg) if f.name not in NOT_RECORDED}
    flags = {name: {k: v for k, v in value.items() if k not in CREDENTIAL_KEYS} if isinstance(value, dict) else value
             for name, value in flags.items()}
    return json.loads(json.dumps(flags, default=str))


def say_or_refuse_changes(saved: dict | None, cfg: AsyncGRPOConfig, checkpoint: str, say: bool = True) -> None:
    """Compares ``cfg`` with the flags ``checkpoint`` was trained with (``saved``; None for a checkpoint that
    recorded none): ConfigError naming a row-layout change, else one line a change (where ``say``: the first of
    the PS's ranks)."""
    if not saved:
        return
    now = recorded_flags(cfg)
    changed = [name for name in now if name in saved and now[name] != saved[name]]
    where = checkpoint.rstrip("/").rsplit("/", 1)[-1]
    fixed = [(ROW_LAYOUT_FLAGS, "the jobs this run has thrown hold rows for its group size and batch")]
    if saved.get("use_peft") or now.get("use_peft"):  # (without an adapter, its flags are nobody's)
        fixed.append((ADAPTER_FLAGS, "the run's checkpoints hold a LoRA adapter of its shape and scale (or the whole "
                                     "model)"))
    for names, why in fixed:
        if refused := [name for name in changed if name in names]:
            flags = ", ".join(f"--{name} {now[name]!r} ({where} was trained with {saved[name]!r})" for name in refused)
            raise ConfigError(f"{flags}: {why}, which cannot change within a run; relaunch with the run's values, or "
                              "start a new run with another --run_dir")
    for name in changed if say else ():
        after = ("applies to every job generated from now on, those already thrown too" if name in GENERATION_FLAGS
                 else "applies from the next step on" if name in TRAINING_FLAGS
                 else "applies from now on, to the jobs already thrown too" if name in QUEUE_FLAGS
                 else "applies to the jobs drawn and scored from now on; the results already scored keep their "
                      "rewards" if name in INPUT_FLAGS
                 else "applies from now on")
        log.info("[train] resumed with --%s %r where %s was trained with %r: it %s", name, now[name], where,
                 saved[name], after)


def say_if_the_schedule_changed(checkpoint: str, state, lr_scheduler, lr_scheduler_type) -> None:
    """A run resumed with another --max_steps than it was trained towards: transformers rebuilds the learning-rate
    schedule over the new length, so the learning rate jumps (a finished run's schedule had decayed to 0). Said in
    one line, with the rates before and after. ``state``: the resumed trainer's (TrainerState)."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return
    old_steps = saved.get("max_steps")
    if not old_steps or old_steps == state.max_steps:
        return
    old_lr = next((entry["learning_rate"] for entry in reversed(saved.get("log_history", []))
                   if "learning_rate" in entry), None)
    new_lr = None
    if getattr(lr_scheduler, "lr_lambdas", None):  # transformers' schedules (get_last_lr is the saved, old rate)
        new_lr = lr_scheduler.base_lrs[0] * lr_scheduler.lr_lambdas[0](state.global_step)
    log.info("[train] resumed at step %d of a run trained towards max_steps=%d, now max_steps=%d: the "
             "learning-rate schedule (%s) is recomputed over %d steps: the learning rate goes from %s "
             "(its last step's) to %s",
             state.global_step, old_steps, state.max_steps, getattr(lr_scheduler_type, "value", lr_scheduler_type),
             state.max_steps, *("-" if lr is None else f"{lr:.3g}" for lr in (old_lr, new_lr)))
