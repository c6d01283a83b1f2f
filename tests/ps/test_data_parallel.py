"""The PS as several data-parallel processes (torchrun, gloo on CPU): the first rank takes each job from
the queue and every rank trains on its slice, so 2 ranks make the update 1 rank makes on the same jobs.

Synchronous mode (--max_staleness 0) and seeded sampling make the jobs the same in both runs: job ids,
prompts, and the weights each job is generated with (up to float rounding between the runs)."""

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    PROCESS_ENV,
    PROCESSES,
    PYTHON,
    REPO,
    assert_exactly_once,
    demo_config,
    expect_exit,
    launch_sh,
    metrics,
    start_process,
    start_ps_ranks,
    wait_for,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.process

STEPS = 2
GLOBAL_BATCH = 16  # completions per job: 2 prompts x 8 generations
# Plain SGD without clipping: Adam and gradient clipping would hide a gradient of the wrong scale (each rank
# training on the whole job instead of its slice doubles it).
SCALE_SENSITIVE = ["--optim", "sgd", "--learning_rate", "0.1", "--max_grad_norm", "0"]
# Two ranks sum their gradients in another order than one rank: the updates agree to float32 rounding.
RELATIVE_TOLERANCE = 1e-4


def train(tmp_path: Path, processes: int, *extra: str, steps: int = STEPS, jobs: int = STEPS) -> Path:
    run = tmp_path / f"run{processes}"
    flags = ["--device_type", "cpu", "--max_steps", str(steps), "--max_staleness", "0", "--seed", "0",
             "--per_device_train_batch_size", str(GLOBAL_BATCH // processes), "--save_strategy", "steps",
             "--save_steps", "1", *SCALE_SENSITIVE, *extra]
    ps = start_ps_ranks(run, tmp_path / f"ps{processes}.log", processes, *flags)
    worker = start_process(run, tmp_path / f"worker{processes}.log", "worker", "--device", "1",
                           "--ps_processes", str(processes), *flags)
    try:
        expect_exit(ps, 0, tmp_path / f"ps{processes}.log", 400)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    assert_exactly_once(run, jobs=jobs)
    return run


def weights(run: Path, folder: str, file: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(run / folder / file))


def relative_difference(start: dict, one: dict, two: dict) -> tuple[float, float]:
    """The update one rank made (its norm), and how far the two-rank weights are from it, relative to it."""
    update = torch.cat([(one[k] - start[k]).flatten() for k in start]).norm()
    difference = torch.cat([(two[k] - one[k]).flatten() for k in start]).norm()
    return float(update), float(difference / update)


def test_two_ranks_train_as_one(tmp_path):
    one, two = train(tmp_path, 1), train(tmp_path, 2)
    start = weights(one, "demo_model")
    assert all(torch.equal(start[k], v) for k, v in weights(two, "demo_model").items())  # the same model
    update, difference = relative_difference(start, weights(one, "final_model"), weights(two, "final_model"))
    assert update > 0
    assert difference < RELATIVE_TOLERANCE, f"relative difference {difference:.2e}"


def test_two_ranks_train_a_lora_adapter_over_several_iterations_as_one(tmp_path):
    """--use_peft and --num_iterations 2 (each job trains 2 optimizer steps, the second against the proximal
    log-probs each rank computes on its slice): 2 jobs, 4 steps, the same adapter from 1 and 2 ranks."""
    lora = ["--use_peft", "--lora_r", "4", "--lora_target_modules", "all-linear", "--lora_dropout", "0",
            "--num_iterations", "2"]
    one, two = (train(tmp_path, n, *lora, steps=4, jobs=2) for n in (1, 2))
    adapter = "adapter_model.safetensors"
    trained_one, trained_two = weights(one, "final_model", adapter), weights(two, "final_model", adapter)
    start = weights(one, "checkpoints/checkpoint-2", adapter)  # after the first job (lora_B starts at zero)
    update, difference = relative_difference(start, trained_one, trained_two)
    assert update > 0
    assert difference < RELATIVE_TOLERANCE, f"relative difference {difference:.2e}"


def test_two_ranks_resume_from_their_checkpoint(tmp_path):
    """A 2-rank PS stopped at its end (max_steps 1) and relaunched with max_steps 2 resumes from the checkpoint
    both ranks saved, and trains the second job once. Each rank, done, leaves without the interpreter's
    finalisation, where gloo's threads can abort it and fail the run (tests/processes/finalisation_watch)."""
    run, marks = tmp_path / "run", tmp_path / "finalised"
    marks.mkdir()
    env = {**PROCESS_ENV, "FINALISATION_MARKS": str(marks),
           "PYTHONPATH": os.pathsep.join(p for p in (str(PROCESSES / "finalisation_watch"),
                                                     PROCESS_ENV.get("PYTHONPATH")) if p)}
    flags = ["--device_type", "cpu", "--max_staleness", "0", "--seed", "0", "--per_device_train_batch_size", "8",
             "--save_strategy", "steps", "--save_steps", "1"]
    worker = start_process(run, tmp_path / "worker.log", "worker", "--device", "1", "--ps_processes", "2", *flags)
    try:
        for steps in (1, 2):
            ps = start_ps_ranks(run, tmp_path / "ps.log", 2, "--max_steps", str(steps), *flags, env=env)
            expect_exit(ps, 0, tmp_path / "ps.log", 400)
            assert not list(marks.iterdir()), "a finished rank ran the interpreter's finalisation"
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    assert "resuming from" in (tmp_path / "ps.log").read_text()
    assert (run / "checkpoints" / "checkpoint-2" / "asyncgrpo_state.json").exists()
    assert_exactly_once(run, jobs=2)


def test_launch_with_two_ps_processes_and_two_workers(tmp_path):
    """launch.sh --ps-procs 2: two PS ranks (torchrun, gloo), two workers, every job trained on once."""
    run = tmp_path / "run"
    result = launch_sh(tmp_path, "--workers", "2", "--ps-procs", "2", "--device", "cpu", "--run-dir", str(run),
                       "--max-steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--seed", "0")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4]  # written once, by the first rank
    assert_exactly_once(run, jobs=4)
    ps_log = (run / "logs" / "log_parameter_server.txt").read_text()
    assert ps_log.count("[model] loaded") == 2  # both ranks trained
    assert "Root Cause" not in ps_log and "terminate called" not in ps_log  # no rank failed, even after training


def test_ps_processes_other_than_the_ranks_started_is_refused(tmp_path):
    """--ps_processes 2 given to one process: a one-line error, exit 2, nothing started in the run."""
    result = subprocess.run([PYTHON, "-m", "ps", "--run_dir", str(tmp_path / "run"), "--device_type", "cpu",
                             "--ps_processes", "2"], cwd=REPO, env=PROCESS_ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--ps_processes 2, but the PS was started as 1 process(es)" in result.stderr.splitlines()[-1]
    assert not (tmp_path / "run" / "queue").exists()


def test_fsdp_flags_shard_the_ps_only(tmp_path):
    """--fsdp: refused for a PS of one process and for FSDP1 (one line each); on CPU a note says nothing is
    sharded (accelerate shards on GPUs only); a worker given the same flags builds its trainer unsharded
    (transformers' Trainer refuses fsdp in a single process)."""
    from asyncgrpo.checks import check_inputs
    from asyncgrpo.config import ConfigError
    from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer, repeat_digit_reward
    from worker.generate import build_trainer

    fsdp = ["--fsdp", "full_shard"]
    with pytest.raises(ConfigError, match="^--fsdp shards the PS's model across its processes"):
        demo_config(tmp_path, *fsdp)
    with pytest.raises(ConfigError, match="^--fsdp_config version 1: asyncgrpo publishes the weights of FSDP2 only"):
        demo_config(tmp_path, *fsdp, "--ps_processes", "2", "--fsdp_config", '{"version": 1}')
    cfg = demo_config(tmp_path, *fsdp, "--ps_processes", "2")
    assert any(note.startswith("--fsdp: accelerate shards a model on GPUs only") for note in
               check_inputs(cfg, tmp_path / "run"))
    tokenizer = build_tokenizer()
    worker = build_trainer(cfg, build_model(tokenizer=tokenizer), tokenizer, [repeat_digit_reward],
                           build_dataset(n=40))
    assert not worker.is_fsdp_enabled and cfg.fsdp  # the worker's copy of the flags, not the PS's


def test_launch_with_two_ps_processes_exits_with_the_first_ranks_status(tmp_path):
    """torchrun exits 1 whatever its ranks exit with; launch.sh reports the first rank's own status: 3 when
    another PS holds the run (its lock held here), with the PS's one-line reason."""
    import fcntl
    import os

    run = tmp_path / "run"
    run.mkdir()
    lock = os.open(run / "ps.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        result = launch_sh(tmp_path, "--workers", "1", "--ps-procs", "2", "--device", "cpu", "--run-dir", str(run),
                           "--max-steps", "2")
    finally:
        os.close(lock)
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "ps: error: another parameter server is running on" in result.stdout + result.stderr


def rank_pid(run: Path, rank: int) -> int | None:
    """The pid of the PS rank ``rank`` of the run (torchrun's child: ``-m ps``, RANK in its environment)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"ps" in cmdline and str(run).encode() in cmdline and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


def test_a_ps_rank_that_dies_is_named_on_the_terminal(tmp_path):
    """A rank killed in training: launch.sh stops, exit non-zero, and names the rank torchrun saw fail first
    with its exit code (torchrun's banner, not the log's last lines)."""
    run = tmp_path / "run"
    launch = subprocess.Popen(["bash", str(REPO / "launch.sh"), "--workers", "1", "--ps-procs", "2", "--device",
                               "cpu", "--run-dir", str(run), "--max-steps", "100000"], cwd=tmp_path, env=PROCESS_ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: len(metrics(run)) >= 2, "two training steps", 300, procs=(launch,))
        os.kill(wait_for(lambda: rank_pid(run, 1), "rank 1's pid", 30), signal.SIGKILL)
        out, _ = launch.communicate(timeout=180)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
    assert launch.returncode != 0
    [line] = [x for x in out.splitlines() if x.startswith("torchrun: ")]
    assert line.startswith("torchrun: the first PS rank to fail: rank: ") and "; exitcode: " in line, out[-3000:]
    assert "{'" not in out  # no metric dictionaries from the log's tail
