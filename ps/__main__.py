"""Run the parameter server:

    python -m ps --run_dir RUN [--max_steps N] [--config run.yaml] [any GRPOConfig / asyncgrpo flag]
    python -m ps --check_only ...     # validate the inputs, print the run directory and device, start nothing
    python -m ps --help               # every flag

launch.sh starts it together with the workers. With the same --run_dir it resumes from
the newest checkpoint. At the end it saves the model and tokenizer to --output_dir, or to
RUN/final_model when --output_dir was not given. Exit status: 0 trained, 1 the job pipeline
failed (full disk, ...), 2 bad input, 3 another PS holds the run.

Data-parallel (--ps_processes K): started K times by torchrun or accelerate launch
(launch.sh --ps-procs K); the first rank holds the lock and is the queue client, every
rank trains on its slice of each job (ps/trainer.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

from asyncgrpo.checks import check_inputs
from asyncgrpo.config import ConfigError
from asyncgrpo.config_parser import parse_config
from asyncgrpo.inputs import (
    load_eval_dataset,
    load_model_and_tokenizer,
    load_reward_funcs,
    load_train_dataset,
    model_path,
    write_demo_model_once,
)
from asyncgrpo.messages import first_line, quiet_library_deprecations
from asyncgrpo.run import RunDir, runs_dir
from asyncgrpo.run.liveness import PSAlreadyRunning, PSHeartbeat, PSRunLock
from asyncgrpo.run.rundir import PSStatus
from asyncgrpo.supervisor import watch_supervisor
from asyncgrpo.user_code import load_rollout_hooks
from ps.exits import check_disk_for_checkpoints, checkpoint_misfit, first_cause

log = logging.getLogger("asyncgrpo.ps")
DESCRIPTION = ("The asyncgrpo parameter server: trains with TRL's GRPOTrainer on results that workers generate. "
               "--check_only: check the inputs, print the run directory and (a second line) the device and the GPUs "
               "torch sees, start nothing. Every other flag below; --config FILE.yaml sets any of them.")


def set_tensorboard_dir(final_dir: str) -> None:
    """--report_to tensorboard writes where trl grpo's does, under --output_dir (runs/DATE_HOST), not under the
    checkpoints folder that output_dir becomes here; a TENSORBOARD_LOGGING_DIR already set wins, as in TRL."""
    from transformers.integrations.integration_utils import default_logdir

    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", os.path.join(final_dir, default_logdir()))


def lora_words(cfg) -> str:
    """What the run's first line says of --use_peft: that only a LoRA adapter trains, and its shape."""
    if not cfg.use_peft:
        return ""
    return f", a LoRA adapter (r={cfg.lora_r}, alpha={cfg.lora_alpha}) trained on the frozen model"


def main(argv: list[str] | None = None) -> int:
    # accelerate's is_cuda_available() (Trainer.train calls it first thing) sets this variable and removes it
    # again, while TRL's telemetry thread resolves a host name, which reads the environment in C (getenv). Adding
    # or removing a variable can make glibc move the environment array and free the old one under that reader:
    # a SIGSEGV in getenv, rarely. Present from the start, the variable is only ever replaced in place.
    # "0" is torch's default (only "1" selects its NVML-based check).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    argv = list(sys.argv[1:] if argv is None else argv)
    check_only = "--check_only" in argv
    joining = "--joining" in argv  # with --check_only: for workers joining the run (launch.sh --join)
    argv = [a for a in argv if a not in ("--check_only", "--joining")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ps %(levelname)s %(message)s")
    quiet_library_deprecations()
    if check_only:
        _quiet_libraries()
    try:
        cfg = parse_config(argv, prog="python -m ps", description=DESCRIPTION)
        run_root = cfg.run_dir or str(runs_dir() / time.strftime("%Y%m%d-%H%M%S"))
        notes = check_inputs(cfg, run_root)
        if check_only:
            if not joining:  # workers that join a run want its PS running
                PSRunLock.refuse_if_held(RunDir(Path(run_root).expanduser().resolve()))
            for note in notes:
                print(f"ps: note: {note}", file=sys.stderr)
            print(os.path.abspath(os.path.expanduser(run_root)))
            # The device --device_type auto resolved to, and the GPUs torch sees: launch.sh asks no other interpreter.
            import torch

            print(cfg.device_type, torch.cuda.device_count() if cfg.device_type == "cuda" else 0)
            return 0
        if cfg.ps_processes != cfg.world_size:
            raise ConfigError(f"--ps_processes {cfg.ps_processes}, but the PS was started as {cfg.world_size} "
                              "process(es) (start it with torchrun --nproc_per_node K, or launch.sh --ps-procs K)")
        first_rank = cfg.process_index == 0
        run = RunDir.create(run_root, cfg.share_with_group)  # idempotent: every rank may create it
        lock = PSRunLock(run) if first_rank else None
    except ConfigError as err:
        say_error(err)
        return 2
    except PSAlreadyRunning as err:
        say_error(err)
        return 3
    # Explicit handlers: a process that bash starts in the background inherits SIGINT ignored,
    # and Python keeps it that way. Each signal unwinds training (threads stopped, lock freed);
    # with --checkpoint_on_sigterm, SIGTERM stops at the next batch boundary with a checkpoint saved there.
    signal.signal(signal.SIGTERM, _save_and_stop if cfg.checkpoint_on_sigterm else _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # under nohup it stays ignored: the run goes on
        signal.signal(signal.SIGHUP, _interrupt)  # its terminal closed: unwind as on Ctrl-C (weight buffers freed)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: where each thread is, into the log
    watch_supervisor("ps")  # launch.sh killed outright: SIGTERM, as a scheduler sends it
    from ps.pipeline import PipelineError, StopRequested

    try:
        with PSHeartbeat(run):
            return train(cfg, run)
    except ConfigError as err:  # the model did not load after all
        say_error(err)
        return 2
    except PipelineError as err:  # its traceback is in the log above; the cause is this line
        log.error("[train] stopped: %s", err)
        say_error(err)
        return 1
    except KeyboardInterrupt:
        log.warning("[train] interrupted; %s", resume_line(run))
        return 130
    except StopRequested:  # the checkpoint is saved (train)
        return 128 + signal.SIGTERM
    except Exception as err:  # the traceback goes to the log, the first cause to the operator's terminal
        log.error("[train] stopped: %s", first_line(err), exc_info=err)
        say_error(first_cause(err, run.root))
        return 1
    finally:
        if lock is not None:
            lock.release()


def _quiet_libraries() -> None:
    """--check_only speaks in one line: no library warnings, logs or progress bars before it."""
    import datasets
    import huggingface_hub
    import transformers

    warnings.simplefilter("ignore")
    transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    logging.getLogger("asyncgrpo").setLevel(logging.ERROR)


def _interrupt(signum, frame):
    """The first SIGINT, SIGTERM or SIGHUP unwinds training; later ones (a terminal's Ctrl-C reaches every process,
    then launch.sh sends SIGTERM) must not cut the clean-up short that frees the weight buffers."""
    for later in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(later) is not signal.SIG_IGN:  # (SIGHUP under nohup)
            signal.signal(later, _already_stopping)
    global _first_signal_at
    _first_signal_at = time.monotonic()
    INTERRUPTED.set()
    _raise_interrupt(signum, frame)


_first_signal_at = 0.0
ONE_STOP_S = 2.0  # a terminal's Ctrl-C and launch.sh's SIGTERM that follows it: one request to stop, said once


# Set by the first SIGINT, SIGTERM or SIGHUP. Its KeyboardInterrupt unwinds training at once; while training goes on
# after it all the same (the interrupt put off, below, or swallowed: a KeyboardInterrupt raised inside a finalizer
# is only printed), the trainer raises one at its next safe point (ps/pipeline.py): the later signals only log.
INTERRUPTED = threading.Event()
# Standard-library functions that take a lock for their caller, which protects it (its with-block, its try) only once
# they return: a KeyboardInterrupt raised inside one leaves the lock held for good. threading's Condition.__enter__
# is how Event.set takes its lock, and the trainer wakes the producer with Event.set every step; the stop wakes it
# with the same event, and would wait for that lock forever. Inside these the interrupt is put off.
_LOCK_TAKERS = {(threading.__file__, "__enter__"), (logging.__file__, "acquire"), (logging.__file__, "_acquireLock"),
                ("<frozen importlib._bootstrap>", "acquire"), ("<frozen importlib._bootstrap>", "__enter__"),
                ("<frozen importlib._bootstrap>", "_get_module_lock")}
_put_off: int | None = None  # the signal whose KeyboardInterrupt was put off


def _raise_interrupt(signum: int, frame) -> None:
    global _put_off
    if frame is not None and (frame.f_code.co_filename, frame.f_code.co_name) in _LOCK_TAKERS:
        _put_off = signum  # raised by a later signal, or at the trainer's next safe point
        return
    _put_off = None
    raise KeyboardInterrupt(f"signal {signum}")


# Set by SIGTERM under --checkpoint_on_sigterm: the trainer stops at the next batch boundary (ps/pipeline.py).
STOP_AT_BOUNDARY = threading.Event()


def _save_and_stop(signum, _frame):
    """SIGTERM under --checkpoint_on_sigterm: training goes on to the next batch boundary (at once when it waits
    for results), saves a checkpoint there and stops. A scheduler signals every process of a job, and a launcher
    passes its own SIGTERM on: more SIGTERMs change nothing; SIGINT still unwinds at once."""
    if not STOP_AT_BOUNDARY.is_set():
        log.warning("[train] SIGTERM: saving a checkpoint at the next batch boundary, then stopping")
    STOP_AT_BOUNDARY.set()


def _already_stopping(signum, frame):
    if _put_off is not None:  # the first signal's interrupt was put off: raise it here, unless this is no better
        _raise_interrupt(_put_off, frame)
    log.log(logging.INFO if time.monotonic() - _first_signal_at < ONE_STOP_S else logging.WARNING,
            "[ps] signal %d: already stopping (freeing the weight buffers); SIGKILL to force, SIGUSR1 to log where "
            "each thread is", signum)


def train(cfg, run: RunDir) -> int:
    import torch
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    from asyncgrpo.run.checkpoints import DamagedCheckpoint, checkpoint_to_resume, read_ledger
    from ps.flag_changes import say_or_refuse_changes
    from ps.pipeline import StopRequested
    from ps.trainer import AsyncGRPOTrainer

    # --output_dir (TRL's) is where the final model goes; checkpoints live in the run.
    final_dir = os.path.abspath(cfg.final_model_dir) if cfg.final_model_dir else str(run.final_model)
    cfg.output_dir = str(run.checkpoints)
    set_tensorboard_dir(final_dir)
    if cfg.model_name_or_path is None:
        # The first rank writes the demo model (save_pretrained writes weights on the main process only).
        if PartialState().is_main_process:
            write_demo_model_once(run.root, cfg)
        PartialState().wait_for_everyone()
    path = write_demo_model_once(run.root, cfg) if cfg.model_name_or_path is None else model_path(cfg, run.root)
    model, tokenizer = load_model_and_tokenizer(path, cfg)
    # The first rank removes incomplete checkpoints before anything is written (on a full disk they hold the
    # space a relaunch needs); then every rank resumes from the same one.
    try:
        resume = checkpoint_to_resume(run.checkpoints) if PartialState().is_main_process else None
    except DamagedCheckpoint as err:  # (a relaunch would stop here again: bad input, exit 2)
        raise ConfigError(str(err)) from err
    try:
        trainer = AsyncGRPOTrainer(cfg, run, model, tokenizer, load_reward_funcs(cfg), load_train_dataset(cfg),
                                   eval_dataset=load_eval_dataset(cfg), hooks=load_rollout_hooks(cfg),
                                   stop_at_boundary=STOP_AT_BOUNDARY, interrupted=INTERRUPTED)
    except ValueError as err:  # (before a step: bad input, exit 2)
        if (missing := cfg.lora_targets_missing(model, err)) is not None:
            raise ConfigError(missing) from err
        raise
    try:
        first_rank = trainer.is_queue_client
        previous = run.read_ps_status() if first_rank else None  # the PS before this one, if any
        if first_rank:
            check_disk_for_checkpoints(run, trainer.model, cfg.save_strategy != "no")
        if trainer.accelerator.num_processes > 1:
            resume = broadcast_object_list([resume], from_process=0)[0]
        saved = read_ledger(resume) if resume else None
        if saved is not None:  # (every rank: a refusal stops them all)
            say_or_refuse_changes(saved.pipeline_state.get("flags"), cfg, resume, say=first_rank)
        last = last_step(trainer, cfg)
        if first_rank:
            # Workers match its generation; recovery and ls go by its deadline, lease and attempts.
            status = PSStatus.starting(path, resume, cfg.generation_settings(), cfg.job_timeout_s or None,
                                       lease_s=cfg.lease_s, max_attempts=cfg.max_attempts, previous=previous,
                                       max_steps=last)
            run.write_ps_status(status)
        log.info("[train] run %s: model %s, %s, max_steps=%d%s%s", run.root, path, cfg.device_type, last,
                 lora_words(cfg), f", resuming from {resume}" if resume else "")
        try:
            if saved is not None and saved.global_step >= last:
                # transformers checks max_steps only after a step: resuming there would train one more
                log.info("[train] %s already reached %s: nothing to train", resume,
                         f"max_steps={last}" if cfg.max_steps > 0 else f"step {last}, the end of its epochs")
                trainer.state.global_step = saved.global_step
                trainer._load_from_checkpoint(resume)  # the final save saves the checkpoint's weights (or adapter)
            else:
                trainer.train(resume_from_checkpoint=resume)
        except StopRequested:
            step = trainer.state.global_step
            saved = trainer.save_checkpoint_at_stop()
            what = (f"its checkpoint saved: {saved}" if saved else
                    "its checkpoint was saved already" if step else "nothing trained yet")
            log.warning("[train] stopped after step %d on SIGTERM, %s; relaunch with the same --run_dir to resume "
                        "from it", step, what)
            raise
        except RuntimeError as err:
            if resume and (misfit := checkpoint_misfit(err, resume, path, previous)):
                raise misfit from err
            raise
        trainer.finish()
        trainer.save_model(final_dir)  # model, tokenizer (save_pretrained), training_args.bin: as trl grpo saves
        if first_rank:
            if cfg.use_peft:
                log.info("[train] final LoRA adapter saved to %s (the adapter only: load it onto %s with peft's "
                         "PeftModel.from_pretrained)", final_dir, path)
            else:
                log.info("[train] final model saved to %s", final_dir)
            run.write_ps_status(status.finished(trainer.state.global_step, final_dir))
    finally:
        trainer.close()  # however the PS ends (an error, a signal), its weight buffers go
    if torch.distributed.is_initialized():  # every rank done before the group goes (else some abort at exit)
        trainer.accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()
    return 0


def last_step(trainer, cfg) -> int:
    """The run's last step: --max_steps, or where it is -1, what transformers makes of --num_train_epochs."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    return trainer.set_initial_training_values(cfg, trainer.get_train_dataloader())[-1]


def resume_line(run: RunDir) -> str:
    """Where a relaunch resumes, and what it trains again: the steps after the newest complete checkpoint."""
    from asyncgrpo.run.checkpoints import newest_complete_checkpoint, read_ledger

    step = run.read_global_step() or 0
    try:
        checkpoint = newest_complete_checkpoint(run.checkpoints)
        saved = read_ledger(checkpoint).global_step if checkpoint is not None else 0
    except (OSError, ValueError):  # (a ledger that cannot be read: the relaunch says which)
        saved = 0
    if not step:
        return "no step trained yet: a relaunch with the same --run_dir starts from the beginning"
    if saved >= step:
        return f"trained {step} step(s), all saved: relaunch with the same --run_dir to go on from there"
    if not saved:
        return (f"trained {step} step(s), no checkpoint saved yet: a relaunch with the same --run_dir starts from the "
                "beginning (--save_steps saves more often, --checkpoint_on_sigterm saves on SIGTERM)")
    lost = f"steps {saved + 1}-{step} are" if step > saved + 1 else f"step {step} is"
    return (f"trained {step} step(s), the last checkpoint is of step {saved}: relaunch with the same --run_dir to "
            f"resume there ({lost} trained again; --save_steps saves more often, --checkpoint_on_sigterm saves on "
            "SIGTERM)")


_error_said: list[str] = []  # the one-line reason said last, for launch.sh


def say_error(reason) -> None:
    """The PS's one-line reason for stopping, on stderr (the log launch.sh shows), and kept for
    ``leave_status_for_the_launcher``: on a full disk the log cannot take it."""
    line = f"ps: error: {reason}"
    _error_said[:] = [line]
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr)


def leave_status_for_the_launcher(status: int) -> None:
    """torchrun exits 1 whatever status its ranks exit with: the first rank writes its own (2 bad input,
    3 another PS, ...) to the file launch.sh names, which reports that instead, and the PS's one-line reason
    (``say_error``) on the next line, which launch.sh shows where the log lacks it (a full disk)."""
    path = os.environ.get("ASYNCGRPO_PS_STATUS_FILE")
    if status and path and os.environ.get("RANK", "0") == "0":
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write("".join(f"{line}\n" for line in [str(status), *_error_said]))


if __name__ == "__main__":
    exit_status = main()
    leave_status_for_the_launcher(exit_status)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank of a data-parallel PS, done (its group destroyed, everything saved and closed): it leaves without
        # the interpreter's finalisation, in which gloo's threads can abort the process (SIGABRT, "terminate called
        # without an active exception"; seen once in a few CPU runs), and torchrun would report the run failed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_status)
    sys.exit(exit_status)
