"""The demo task's settings as the tests use them: the flags of a short real run (run_flags, and the 8-step
DEMO_RUN_FLAGS of the shared demo run), the demo task's AsyncGRPOConfig as every process parses it
(demo_config), its defaults as command-line flags (demo_flags), and a TRL user's folder with a model, a
dataset and a reward function (write_user_folder, REWARDS_PY).
"""

from __future__ import annotations

import json
from pathlib import Path


def run_flags(max_steps: int | None = None, *, save_steps: int | None = None, lease_s: float | None = 4,
              seed: int = 0) -> list[str]:
    """The flags of a short real run: ``max_steps`` (left out: None), a lease short enough to recover a killed
    worker's job quickly (``lease_s``; None: the default lease), a checkpoint every ``save_steps`` steps (None:
    the run's default checkpoints), and a seed."""
    flags = [] if max_steps is None else ["--max_steps", str(max_steps)]
    if lease_s is not None:
        flags += ["--lease_s", f"{lease_s:g}"]
    if save_steps is not None:
        flags += ["--save_strategy", "steps", "--save_steps", str(save_steps)]
    return [*flags, "--seed", str(seed)]


# The demo task, 8 steps, checkpoints at steps 3 and 6 (and the final one).
DEMO_RUN_FLAGS = run_flags(8, save_steps=3)


# ---------------------------------------------------------------------- the demo task's config


def demo_config(tmp_path, *flags: str, **fields):
    """The demo task's AsyncGRPOConfig as every process parses it: ``parse_config`` with no model, dataset or
    reward flag, so the demo module's table (asyncgrpo.tasks.demo.DEMO_DEFAULTS, and the demo's checkpoints)
    fills the rest; on CPU, seed 0, no progress bars, output in ``tmp_path/out``. Then ``flags`` (command-line
    words) and ``fields`` (name=value, passed as flags: a list as several words, a dict as JSON, None not at all,
    leaving the field's default): they win."""
    from asyncgrpo.config_parser import parse_config

    argv = ["--device_type", "cpu", "--seed", "0", "--disable_tqdm", "true",
            "--output_dir", str(Path(tmp_path) / "out"), *flags]
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            argv += [f"--{name}", *map(str, value)]
        else:
            argv.append(f"--{name}={json.dumps(value) if isinstance(value, dict) else value}")
    return parse_config(argv)


def demo_flags() -> list[str]:
    """The demo task's settings (DEMO_DEFAULTS) as command-line flags, for a run that names its own model,
    dataset or reward function: any of them turns the demo's defaults off (asyncgrpo.config_parser). max_steps is left
    out (a test's run has its own length)."""
    from asyncgrpo.tasks.demo import DEMO_DEFAULTS

    return [f"--{name}={value}" for name, value in DEMO_DEFAULTS.items() if name != "max_steps"]


# ---------------------------------------------------------------------- a user's folder


REWARDS_PY = """\
import os
from pathlib import Path


def ones(prompts, completions, **kwargs):
    with open(Path(__file__).parent / "reward_calls.txt", "a") as f:  # who called: the PS (evaluation), workers
        f.write(f"{os.getpid()}\\n")
    return [c.count("1") / max(1, len(c)) for c in completions]
"""


def write_user_folder(folder) -> Path:
    """A TRL user's folder: ``mymodel/`` (the tiny demo Llama, float32, with its tokenizer), ``data/`` with a
    train and a test split (train.jsonl: prompts "0:".."7:", test.jsonl: two), and ``rewards.py`` whose
    ``ones`` appends the calling process's pid to ``reward_calls.txt``."""
    from asyncgrpo.tasks.demo import write_demo_model

    folder = Path(folder)
    write_demo_model(folder / "mymodel")
    (folder / "data").mkdir()
    (folder / "data" / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}:"}) + "\n" for i in range(8)))
    (folder / "data" / "test.jsonl").write_text("".join(json.dumps({"prompt": f"{i}:"}) + "\n" for i in (1, 2)))
    (folder / "rewards.py").write_text(REWARDS_PY)
    return folder
