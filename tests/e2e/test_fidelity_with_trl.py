"""Synchronous asyncgrpo is TRL, step for step: `launch.sh --workers 1 --max_staleness 0` (real processes) and a
plain TRL GRPOTrainer in this process, same task, model, data and seed, each of TRL's generation batches seeded as
a worker seeds the job it stands for (job k-1 at step k: worker/generate.py job_seed). Their per-step loss, grad
norm and reward are equal to the bit, for a single-turn task (the demo) and a multi-turn one (the lookup task's
tool loop), once the one known difference is taken away on both sides: the order TRL shuffles a batch's rows in
(tests/processes/trl_unshuffled/sitecustomize.py). With it, they differ in the last digits from the first step, enough
for the sampled tokens to part after some dozens of steps (docs/performance.md, "The lookup task against TRL"); left
to run on, TRL's one RNG stream and the workers' per-job seeds sample differently."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
import torch
import trl.trainer.grpo_trainer as grpo_trainer
from helpers import PROCESS_ENV, PROCESSES, REPO, metrics
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from asyncgrpo.tasks import demo, lookup
from worker.generate import job_seed

pytestmark = pytest.mark.filterwarnings("ignore")
STEPS = 4
UNSHUFFLED = PROCESSES / "trl_unshuffled"  # its sitecustomize.py keeps a batch's rows in order in TRL's trainer


class StepLogs(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append({"step": state.global_step, "loss": logs["loss"], "grad_norm": logs["grad_norm"],
                               "reward": logs["reward"]})


def trl_steps(task: str) -> list[dict]:
    """Plain TRL on the built-in task, as asyncgrpo's PS builds it (the task's defaults, seed 0), STEPS steps."""
    if task == "lookup":
        tok = lookup.build_tokenizer()
        model, defaults, reward, hooks = lookup.build_model(seed=0, tokenizer=tok), lookup.LOOKUP_DEFAULTS, \
            lookup.lookup_reward, {"environment_factory": lookup.LookupEnv}
        dataset = lookup.build_dataset(seed=0)
    else:
        tok = demo.build_tokenizer()
        model, defaults, reward, hooks = demo.build_model(seed=0, tokenizer=tok), demo.DEMO_DEFAULTS, \
            demo.repeat_digit_reward, {}
        dataset = demo.build_dataset(seed=0)
    args = GRPOConfig(**{**defaults, **demo.cpu_overrides(), "output_dir": tempfile.mkdtemp(), "seed": 0,
                         "max_steps": STEPS, "disable_tqdm": True, "report_to": "none", "save_strategy": "no"})
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tok, **hooks)
    generate_and_score, batches = trainer._generate_and_score_completions, [0]

    def seeded_as_a_job(inputs):
        torch.manual_seed(job_seed(0, f"{batches[0]:06d}_000"))
        batches[0] += 1
        return generate_and_score(inputs)

    trainer._generate_and_score_completions = seeded_as_a_job
    logs = StepLogs()
    trainer.add_callback(logs)
    trainer.train()
    return logs.steps


@pytest.mark.parametrize("task", ["repeat", "lookup"])
def test_synchronous_asyncgrpo_trains_as_trl_step_for_step(tmp_path, task, monkeypatch):
    run = tmp_path / "run"
    env = {**PROCESS_ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(UNSHUFFLED), PROCESS_ENV.get("PYTHONPATH"))
                                                        if p)}
    result = subprocess.run(["bash", str(REPO / "launch.sh"), "--workers", "1", "--max_staleness", "0", "--seed",
                             "0", "--run-dir", str(run), "--max-steps", str(STEPS), "--builtin_task", task],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)  # as the sitecustomize does
    # TRL with one thread, as the launched processes run (PROCESS_ENV: OMP_NUM_THREADS=1): how many threads split a
    # matrix product can change its rounding (on some CPUs, in the lookup task's second step's grad norm).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours, theirs = metrics(run), trl_steps(task)
    finally:
        torch.set_num_threads(threads)
    assert [m["step"] for m in ours] == [t["step"] for t in theirs] == list(range(1, STEPS + 1))
    for m, t in zip(ours, theirs, strict=True):
        for key in ("loss", "grad_norm", "reward"):
            assert m[key] == t[key], (m["step"], key, m[key], t[key])
