"""One config for every process: TRL's GRPOConfig plus the queue, transport and staleness fields.

Parsed with TRL's ``TrlParser``, so ``--config run.yaml`` and flags both work and every
GRPOConfig field (loss_type, beta, epsilon, num_generations, temperature, ...) means
what it means in TRL. The PS and the workers parse the same arguments.

    cfg = parse_config(["--max_steps", "200", "--reward_funcs", "mypkg.rewards:fn"])
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import yaml
from trl import GRPOConfig, TrlParser

OFF_POLICY_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class ConfigError(ValueError):
    """A bad option or input; its message is one line for the operator."""


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    # What to train. None means the built-in demo task (asyncgrpo.tasks.demo).
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Local folder or hub id of a causal LM (default: the built-in demo model, a tiny Llama made offline)."})
    dataset_name: str | None = field(default=None, metadata={
        "help": "Dataset with a 'prompt' column: a .jsonl or .parquet file, a folder saved with "
                "datasets.save_to_disk, or a hub id (default: the demo task's prompts)."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on when the dataset has several."})
    reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Reward functions by import path 'module:function', f(prompts, completions, **kwargs) -> list[float]; "
                "several allowed, weighted by reward_weights (default: the demo task's reward)."})
    # Where and on what.
    run_dir: str | None = field(default=None, metadata={
        "help": "Run directory: queue, archive, weights, logs, checkpoints, metrics (default: a new folder "
                "under $ASYNCGRPO_RUNS or ~/asyncgrpo-runs)."})
    device_type: str = field(default="auto", metadata={
        "help": "'cpu', 'cuda' or 'auto' (cuda when available). On cpu, bf16 is turned off. (TrainingArguments "
                "already has a 'device'.)"})
    # Flow control and staleness.
    max_pending: int = field(default=8, metadata={"help": "At most this many jobs wait in queue/ as pending."})
    max_outstanding: int = field(default=16, metadata={
        "help": "At most this many jobs thrown and not yet trained on. The producer also throws a job only while "
                "every result in flight can still be trained within max_staleness (admission control)."})
    max_staleness: int = field(default=4, metadata={
        "help": "Train on a result only if trainer_step - its weights_version <= this; staler ones are archived "
                "'stale' and their prompts thrown again. 0 is synchronous mode."})
    consume_order: str = field(default="ready", metadata={
        "help": "'ready': train on the waiting result with the oldest weights first (no head-of-line blocking); "
                "'fifo': in job order."})
    off_policy_correction: str = field(default="token_truncate", metadata={
        "help": "How a result generated with older weights is corrected (decoupled PPO, the proximal policy being "
                "the current one): each token's advantage is weighted by the importance ratio current/behaviour, "
                "'token_truncate' at most off_policy_cap, 'token_mask' zero above the cap, 'sequence_truncate' / "
                "'sequence_mask' one ratio per completion; 'none': TRL's loss clips the ratio current/behaviour at "
                "1 +- epsilon instead."})
    off_policy_cap: float = field(default=2.0, metadata={
        "help": "The cap of off_policy_correction's importance ratio (truncated to it, or masked above it)."})
    # Recovery.
    lease_s: float = field(default=30.0, metadata={
        "help": "A worker silent this long (no heartbeat) has its job recovered."})
    max_attempts: int = field(default=3, metadata={"help": "A job recovered this many times is archived 'orphaned'."})
    # Archive retention (asyncgrpo/jobqueue/retention.py): names in done/ are the ledger and always stay.
    archive_keep_files: int = field(default=0, metadata={
        "help": "Keep the payloads of the newest this many files in done/; older ones are emptied to 0 bytes, their "
                "names kept (never those archived since the newest complete checkpoint). 0 keeps all."})
    archive_keep_mb: float = field(default=0.0, metadata={
        "help": "Keep at most this many MB (10^6 bytes) of payloads in done/, newest first; older files are emptied "
                "as with archive_keep_files (whichever limit is reached first). 0 keeps all."})
    # Transport and events.
    weight_transport: str = field(default="auto", metadata={
        "help": "'auto' (cuda_ipc on GPU, mmap on CPU), 'cuda_ipc', 'mmap', or 'safetensors' "
                "(workers on other hosts)."})
    poll_only: bool = field(default=False, metadata={
        "help": "Poll queue/ instead of waiting for inotify events (NFS and other filesystems without events)."})
    max_failed_in_a_row: int = field(default=8, metadata={
        "help": "Stop the run (the PS exits 1, naming the error) when this many jobs in a row failed on each of "
                "their max_attempts attempts with no result in between: the failure is systematic (a reward "
                "function that always raises, ...). Jobs that fail now and then are dropped and the run goes on. "
                "0: never stop."})

    def __post_init__(self):
        if self.device_type == "auto":
            import torch

            self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device_type == "cpu":
            self.use_cpu, self.bf16, self.fp16 = True, False, False  # GRPOConfig's bf16 default needs a GPU
        checks = {
            "device_type": (self.device_type in ("cpu", "cuda"), "must be cpu, cuda or auto"),
            "consume_order": (self.consume_order in ("ready", "fifo"), "must be ready or fifo"),
            "off_policy_correction": (self.off_policy_correction in OFF_POLICY_MODES,
                                      f"must be one of {', '.join(OFF_POLICY_MODES)}"),
            "off_policy_cap": (self.off_policy_cap > 0, "must be > 0"),
            "weight_transport": (self.weight_transport in ("auto", "cuda_ipc", "mmap", "safetensors"),
                                 "must be auto, cuda_ipc, mmap or safetensors"),
            "max_pending": (self.max_pending >= 1, "must be >= 1"),
            "max_outstanding": (self.max_outstanding >= 1, "must be >= 1"),
            "max_staleness": (self.max_staleness >= 0, "must be >= 0"),
            "lease_s": (self.lease_s > 0, "must be > 0"),
            "max_attempts": (self.max_attempts >= 1, "must be >= 1"),
            "archive_keep_files": (self.archive_keep_files >= 0, "must be >= 0 (0 keeps all)"),
            "archive_keep_mb": (self.archive_keep_mb >= 0, "must be >= 0 (0 keeps all)"),
        }
        for name, (ok, why) in checks.items():
            if not ok:
                raise ConfigError(f"--{name} {getattr(self, name)!r}: {why}")
        super().__post_init__()
        if (self.steps_per_generation * self.num_iterations) % self.gradient_accumulation_steps:
            raise ConfigError(
                f"--steps_per_generation {self.steps_per_generation} x --num_iterations {self.num_iterations} must be "
                f"a multiple of --gradient_accumulation_steps {self.gradient_accumulation_steps}: asyncgrpo trains "
                "each generated batch for whole optimizer steps")

    @property
    def steps_per_job(self) -> int:
        """Optimizer steps one job (one generation batch) trains: TRL splits it into steps_per_generation
        micro-batches and goes over them num_iterations times."""
        return self.steps_per_generation * self.num_iterations // self.gradient_accumulation_steps

    @property
    def is_demo(self) -> bool:
        return self.model_name_or_path is None and self.dataset_name is None and not self.reward_funcs


def _flag_names(argv: list[str]) -> set[str]:
    return {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}


def parse_config(argv: list[str] | None = None) -> AsyncGRPOConfig:
    """Flags and ``--config`` YAML into an AsyncGRPOConfig; ConfigError with one line on bad input.

    Without a model, dataset or reward function, the demo task's defaults fill every field
    the user did not set (on the command line or in the YAML file).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    given = _flag_names(argv)
    if "--config" in argv:
        try:
            with open(argv[argv.index("--config") + 1]) as f:
                given |= set((yaml.safe_load(f) or {}).keys())
        except (IndexError, OSError, yaml.YAMLError, AttributeError) as err:
            raise ConfigError(f"--config: cannot read a YAML mapping: {err}") from None
    if not given & {"model_name_or_path", "dataset_name", "reward_funcs"}:
        from asyncgrpo.tasks.demo import DEMO_DEFAULTS

        # Checkpoints, so that relaunching the demo on its run directory resumes.
        defaults = {**DEMO_DEFAULTS, "save_strategy": "steps", "save_steps": 100, "save_total_limit": 2}
        argv = [f"--{k}={v}" for k, v in defaults.items() if k not in given] + argv
    parser = TrlParser((AsyncGRPOConfig,))

    def one_line_error(message: str):  # argparse would print its whole usage block and exit
        raise ConfigError(message)

    parser.error = one_line_error
    try:
        (cfg,) = parser.parse_args_and_config(argv)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err).strip().splitlines()[0]) from None
    return cfg
