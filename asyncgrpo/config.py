"""One config for every process: TRL's GRPOConfig, TRL's model and dataset flags, TRL's PEFT / QLoRA
flags (asyncgrpo/peft_args.py), plus the queue, transport and staleness fields.

Parsed with TRL's ``TrlParser`` (asyncgrpo/config_parser.py), so ``--config run.yaml`` and flags both
work and every GRPOConfig field (loss_type, beta, epsilon, num_generations, temperature, ...) means
what it means in TRL. The PS and the workers parse the same arguments.

TRL's ``ModelConfig`` and ``ScriptArguments`` cannot be parsed next to GRPOConfig as they are
(both define ``model_name_or_path`` / ``dataset_name``, which asyncgrpo gives a demo default),
so the fields asyncgrpo applies are copied, with TRL's names, defaults and help, into the
``ModelArguments`` and ``DatasetArguments`` dataclasses, mixed into AsyncGRPOConfig: one flat
config object (``cfg.dtype``, ``cfg.dataset_test_split``), pickled into checkpoints with the
rest. TRL's PEFT / QLoRA flags (``--use_peft``, ``--lora_r``, ``--load_in_4bit``, ...) are
added the same way, from ``PeftArgs`` (asyncgrpo/peft_args.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from trl import DatasetMixtureConfig, GRPOConfig

from asyncgrpo.jobqueue.queue import DEFAULT_JOB_TIMEOUT_S, DEFAULT_MAX_ATTEMPTS
from asyncgrpo.peft_args import PeftArgs
from asyncgrpo.run.liveness import DEFAULT_LEASE_S
from asyncgrpo.weights.base import TRANSPORTS

DTYPES = ("auto", "bfloat16", "float16", "float32")  # TRL ModelConfig's choices for --dtype
WORKER_DECODING_MODES = ("auto", "eager", "compiled", "graph", "continuous")  # worker/decoding/build.py builds them
WEIGHT_TRANSPORTS = ("auto", *TRANSPORTS)  # "auto": cuda_ipc on GPU, mmap on CPU (asyncgrpo/weights)
OFF_POLICY_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# The flags a worker must share with the PS: each changes what a job's result holds (its size, sampling, the
# rewards' weights and advantages, the reference log-probs). The PS writes its values in RUN/ps.json.
GENERATION_FLAGS = ("per_device_train_batch_size", "steps_per_generation", "ps_processes", "num_generations",
                    "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "generation_kwargs", "beta", "reward_weights", "scale_rewards", "mask_truncated_completions",
                    "use_peft", "builtin_task", "tools", "environment_factory", "rollout_func",
                    "max_tool_calling_iterations", "tool_timeout_s", "job_timeout_s", "worker_dtype")
BUILTIN_TASKS = ("repeat", "first_digit", "lookup")  # asyncgrpo/tasks/demo.py, asyncgrpo/tasks/lookup.py


class ConfigError(ValueError):
    """A bad option or input; its message is one line for the operator."""


@dataclass
class ModelArguments:
    """TRL's ModelConfig flags that say how the model is loaded, with TRL's names, defaults and meaning
    (``trl grpo`` passes them to ``from_pretrained``). The PS and every worker load it the same way
    (asyncgrpo/inputs.py load_model_and_tokenizer)."""

    # None means the built-in demo task (asyncgrpo.tasks.demo).
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Local folder or hub id of a causal LM (default: the built-in demo model, a tiny Llama made offline)."})
    model_revision: str = field(default="main", metadata={
        "help": "Specific model version to use. It can be a branch name, a tag name, or a commit id."})
    dtype: str | None = field(default="float32", metadata={
        "help": "Override the default `torch.dtype` and load the model under this dtype ('auto': the dtype the "
                "model was saved in). The PS and every worker load it so; a GPU without bfloat16 gets float32 (with a "
                "note).",
        "choices": list(DTYPES)})
    torch_dtype: str | None = field(default=None, metadata={
        "help": "Older name of --dtype.", "choices": list(DTYPES)})
    attn_implementation: str | None = field(default=None, metadata={
        "help": "Which attention implementation to use (eager, sdpa, flash_attention_2, ...)."})

    def _resolve_model_aliases(self) -> None:
        if self.torch_dtype is not None:
            if self.dtype not in ("float32", self.torch_dtype):
                raise ConfigError(f"--torch_dtype {self.torch_dtype} and --dtype {self.dtype}: give one of them")
            self.dtype = self.torch_dtype
        self.torch_dtype = self.dtype


@dataclass
class DatasetArguments:
    """TRL's ScriptArguments flags that say which dataset and splits to use, with TRL's names and defaults."""

    dataset_name: str | None = field(default=None, metadata={
        "help": "Dataset with a 'prompt' column: a .jsonl/.json/.parquet/.csv file, a folder of such files "
                "(train.jsonl, test.jsonl, ...: one split each), a folder saved with datasets.save_to_disk, or a "
                "hub id (default: the demo task's prompts)."})
    dataset_config: str | None = field(default=None, metadata={
        "help": "Dataset configuration name. Corresponds to the `name` argument of the `datasets.load_dataset` "
                "function."})
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split to use for training."})
    dataset_test_split: str = field(default="test", metadata={
        "help": "Dataset split to use for evaluation (with --eval_strategy steps or epoch)."})
    dataset_split: str | None = field(default=None, metadata={"help": "Older name of --dataset_train_split."})
    dataset_streaming: bool = field(default=False, metadata={
        "help": "Whether to stream the dataset (TRL's flag): rows are read as jobs need them, in TRL's order (a "
                "buffered shuffle with --seed, reshuffled each epoch); a resumed PS reads the stream again up to where "
                "it stopped. Needs --max_steps."})

    def _resolve_dataset_aliases(self) -> None:
        if self.dataset_split is not None:
            if self.dataset_train_split not in ("train", self.dataset_split):
                raise ConfigError(f"--dataset_split {self.dataset_split} and --dataset_train_split "
                                  f"{self.dataset_train_split}: give one of them")
            self.dataset_train_split = self.dataset_split
        self.dataset_split = self.dataset_train_split


# More groups of flags are mixed in the same way: a dataclass of fields with defaults, added to
# AsyncGRPOConfig's bases, its checks called from AsyncGRPOConfig.__post_init__ (PeftArgs: TRL's LoRA flags).
@dataclass
class AsyncGRPOConfig(GRPOConfig, ModelArguments, DatasetArguments, PeftArgs, DatasetMixtureConfig):
    # TRL's meaning: where the trained model is saved at the end. Checkpoints go to RUN/checkpoints.
    output_dir: str | None = field(default=None, metadata={
        "help": "Where the parameter server saves the final model and tokenizer (save_pretrained) at the end of "
                "training (default: RUN/final_model). Checkpoints are saved in RUN/checkpoints."})
    # --output_dir as given (None: not given), kept before TrainingArguments fills in its own default.
    final_model_dir: str | None = field(default=None, init=False)
    reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Reward functions f(prompts, completions, **kwargs) -> list[float], by import path 'module:function' "
                "or 'module.function' (modules in the current folder import), a reward trl grpo knows by name "
                "(accuracy_reward, think_format_reward, ...), or a reward model's folder (or hub id) as TRL's "
                "GRPOTrainer takes it; several allowed, weighted by reward_weights (default: the demo task's "
                "reward)."})
    reward_model_name_or_path: str | None = field(default=None, metadata={
        "help": "Reward model id of a pretrained model hosted inside a model repo on huggingface.co or local path to a "
                "directory containing model weights saved using `PreTrainedModel.save_pretrained` (TRL loads it as a "
                "sequence classifier with one label; the PS and every worker each load it on their own device). It "
                "comes first among the rewards, as in trl grpo; alone, it replaces the built-in task's reward."})
    # TRL's GRPOTrainer hooks for multi-turn rollouts (asyncgrpo/user_code.py): TRL's CLI has no flags for them.
    tools: list[str] | None = field(default=None, metadata={
        "help": "Tools the model may call during generation (GRPOTrainer's tools=), by import path 'module:function' "
                "(modules in the current folder import); each needs type hints and a docstring with an Args section, "
                "and the model's chat template must support tool calling. Calls are parsed, run on the worker and "
                "their results appended, up to --max_tool_calling_iterations times; tool-result tokens are not "
                "trained."})
    environment_factory: str | None = field(default=None, metadata={
        "help": "An environment class (GRPOTrainer's environment_factory=) by import path 'module:Class': one instance "
                "per rollout, reset(**row) before it, its public methods exposed as tools, and its get_reward(), if "
                "it has one, a reward."})
    rollout_func: str | None = field(default=None, metadata={
        "help": "Your own generation loop (GRPOTrainer's rollout_func=) by import path 'module:function': "
                "f(prompts, trainer) -> dict with prompt_ids, completion_ids, logprobs (and optionally env_mask, 0 on "
                "tokens the model did not generate); run on the workers."})
    tool_timeout_s: float = field(default=30.0, metadata={
        "help": "The longest one tool call may run on a worker: a call still running then is abandoned and its result "
                "is the timeout's message, as a tool that raises gives its error (counted in tools/failure_frequency). "
                "An environment's reset() or get_reward() past it fails the job. 0: no limit."})
    builtin_task: str = field(default="repeat", metadata={
        "help": "The built-in task trained without --model_name_or_path, --dataset_name and --reward_funcs: 'repeat' "
                "(prompt 'N:', repeat the digit N; reward: the fraction of characters right) or 'first_digit' "
                "(answer with the digit N first; reward 1 or 0, completions end where the model stops, a random "
                "policy scores about 1/16) or 'lookup' (multi-turn: the model calls a tool, lookup(key), to learn a "
                "secret digit, then answers it; asyncgrpo/tasks/lookup.py).", "choices": list(BUILTIN_TASKS)})
    # Where and on what.
    run_dir: str | None = field(default=None, metadata={
        "help": "Run directory: queue, archive, weights, logs, checkpoints, metrics (default: a new folder "
                "under $ASYNCGRPO_RUNS or ~/asyncgrpo-runs)."})
    device_type: str = field(default="auto", metadata={
        "help": "'cpu', 'cuda' or 'auto' (cuda when available). On cpu, bf16 is turned off. (TrainingArguments "
                "already has a 'device'.)"})
    # Data-parallel PS (launch.sh --ps-procs K): the PS's processes, told to the workers too.
    ps_processes: int = field(default=1, metadata={
        "help": "Processes the parameter server trains with (torchrun / accelerate launch; launch.sh --ps-procs sets "
                "it). A job is the global generation batch (per_device_train_batch_size x ps_processes x "
                "steps_per_generation), which the workers generate whole; each PS rank trains on its slice."})
    # A PS rank other than the first waits in a collective while the first waits for a result: the process
    # group's timeout (TrainingArguments' ddp_timeout, 30 min there) must outlast the longest wait for a job.
    ddp_timeout: int = field(default=7 * 24 * 3600, metadata={
        "help": "Timeout in seconds of the PS's process group (several --ps_processes): the other ranks wait in a "
                "collective while the first waits for the workers' next result (default: 7 days)."})
    # Every trainable parameter gets a gradient each step: DDP need not search the graph for unused ones.
    ddp_find_unused_parameters: bool | None = field(default=False, metadata={
        "help": "DDP's find_unused_parameters for a PS with several --ps_processes (default False: every trainable "
                "parameter gets a gradient)."})
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
    dynamic_sampling: bool = field(default=False, metadata={
        "help": "Dynamic sampling (DAPO): drop the groups whose rewards do not spread (a prompt whose completions all "
                "score alike has zero advantage and teaches nothing) and train each step on a full batch of "
                "informative groups, taken from as many results as it needs; the producer throws more jobs as "
                "groups are dropped. Dropped groups are counted per step and archived 'filtered'."})
    dynamic_sampling_max_std: float = field(default=0.0, metadata={
        "help": "With --dynamic_sampling: drop a group whose reward standard deviation is at most this (0: only "
                "groups whose completions all score the same)."})
    difficulty_filter: int = field(default=0, metadata={
        "help": "Difficulty filtering: a prompt whose last this many groups all scored alike (all right or all "
                "wrong) is skipped for --difficulty_filter_wait generation batches, then thrown again; skipped prompts "
                "are counted (prompts_skipped). 0: off."})
    difficulty_filter_wait: int = field(default=10, metadata={
        "help": "With --difficulty_filter: how many generation batches a skipped prompt waits before it comes back."})
    # How workers generate.
    in_flight_updates: bool = field(default=False, metadata={
        "help": "Workers look for newer weights every few decoding steps and sync them in place while a job is "
                "being generated; each token is sampled, and its behaviour log-prob taken, under the weights of its "
                "step, and a result records which versions sampled its tokens. Staleness and admission go by each "
                "result's oldest token. Single-turn generation only (not with tools or a rollout function)."})
    worker_decoding: str = field(default="auto", metadata={
        "help": "'eager': TRL's generate (a dynamic KV cache, one Python-launched forward per token); 'compiled': a "
                "static KV cache and generate's decoding step compiled with torch.compile (CUDA graphs on a GPU); "
                "'graph': the worker's own decoding loop, forward, sampling and bookkeeping of a token in one "
                "compiled graph (where a setting needs generate, e.g. beam search or tools, it decodes as 'compiled' "
                "or eagerly, and says why in its log); 'continuous': the graph's step over --decoding_slots row "
                "slots, a row that ends replaced at once by the next job's (continuous batching; newer weights "
                "reach the jobs between steps, as with --in_flight_updates; where it does not apply it decodes as "
                "'graph' and says why); each compiles at worker start, before the first job. 'auto': graph on CUDA; "
                "on CPU continuous batching run eagerly (nothing compiled: compiling costs tens of seconds at a "
                "worker's start), or eager for a model under 1M parameters or where the engine does not apply."})
    decoding_slots: int = field(default=0, metadata={
        "help": "With continuous batching (--worker_decoding continuous; auto on CPU): the rows a worker decodes at "
                "once, each job's rows joining as slots free up (0: four jobs' rows on CUDA, --jobs_per_generate "
                "jobs' rows on CPU). At least one job's rows."})
    jobs_per_generate: int = field(default=2, metadata={
        "help": "A worker claims up to this many pending jobs at once (never waiting for more) and generates their "
                "rows in one generate call; each stays its own result (weights version, ledger entry, failure). "
                "A larger batch costs little more per call where decoding is bound by kernel launches."})
    # Recovery.
    lease_s: float = field(default=DEFAULT_LEASE_S, metadata={
        "help": "A worker silent this long (no heartbeat) has its job recovered."})
    job_timeout_s: float = field(default=DEFAULT_JOB_TIMEOUT_S, metadata={
        "help": "A job a worker has held this long (from its claim) is failed as that attempt, naming where it was "
                "stuck (a reward function, a tool, generation), and the worker exits to be restarted, giving its "
                "other jobs back: a reward function or tool that never returns cannot stall the run. Past it and "
                "the lease, recovery takes the job back whatever the worker's heartbeat says. 0: no deadline."})
    max_attempts: int = field(default=DEFAULT_MAX_ATTEMPTS, metadata={
        "help": "Attempts per job: a job whose worker raises (generating or scoring) or dies is thrown again, up to "
                "this; then it is archived 'failed' (it raised) or 'orphaned' (its worker died) and not trained on."})
    # Archive retention (asyncgrpo/jobqueue/retention.py): names in done/ are the ledger and always stay.
    archive_keep_files: int = field(default=0, metadata={
        "help": "Keep the payloads of the newest this many files in done/; older ones are emptied to 0 bytes, their "
                "names kept (never those archived since the newest complete checkpoint). 0 keeps all."})
    archive_keep_mb: float = field(default=0.0, metadata={
        "help": "Keep at most this many MB (10^6 bytes) of payloads in done/, newest first; older files are emptied "
                "as with archive_keep_files (whichever limit is reached first). 0 keeps all."})
    max_payload_mb: float = field(default=0.0, metadata={
        "help": "A job or result file larger than this many MB is archived failed_load without being read (0: derived "
                "from the batch shape: 64 MB plus 64 bytes per token of every row at max_completion_length plus 4096 "
                "prompt tokens)."})
    # Transport and events.
    worker_dtype: str | None = field(default=None, metadata={
        "help": "The dtype the workers load the model in and generate with (default: --dtype's). 'bfloat16' on a "
                "float32 PS: workers generate in bfloat16, and workers on other hosts read weights the PS converted "
                "once per version (half the bytes).",
        "choices": [d for d in DTYPES if d != "auto"]})
    weight_transport: str = field(default="auto", metadata={
        "help": "'auto' (cuda_ipc on GPU, mmap on CPU), 'cuda_ipc', 'mmap', or 'safetensors' "
                "(workers on other hosts)."})
    poll_only: bool = field(default=False, metadata={
        "help": "Poll queue/ instead of waiting for inotify events (NFS and other filesystems without events)."})
    share_with_group: bool = field(default=False, metadata={
        "help": "Open the run directory, its files and the shared-memory weight buffers to the run directory's "
                "group (read and write), for workers run by other users of a cluster. By default only their owner "
                "can open them."})
    checkpoint_on_sigterm: bool = field(default=False, metadata={
        "help": "SIGTERM stops the parameter server at the next batch boundary after saving a checkpoint there (what "
                "a scheduler sends before it preempts or requeues a job: the next start resumes from it). Without it "
                "SIGTERM stops at once, and a relaunch resumes from the last checkpoint saved by save_steps. The "
                "Slurm batch script turns it on."})
    max_failed_in_a_row: int = field(default=8, metadata={
        "help": "Stop the run (the PS exits 1, naming the error) when this many jobs in a row failed on each of "
                "their max_attempts attempts with no result in between: the failure is systematic (a reward "
                "function that always raises, ...). Jobs that fail now and then are dropped and the run goes on. "
                "0: never stop."})

    def __post_init__(self):
        if isinstance(self.model_init_kwargs, str) and self.model_init_kwargs.startswith("{"):
            try:
                json.loads(self.model_init_kwargs)
            except ValueError as err:
                raise ConfigError(f"--model_init_kwargs {self.model_init_kwargs!r}: not valid JSON: {err}") from None
        self.final_model_dir = self.output_dir
        self._resolve_model_aliases()
        self._resolve_dataset_aliases()
        # TRL's --datasets mixture, each entry kept as a plain dict (the config is written as JSON, e.g. to
        # TensorBoard); asyncgrpo/inputs.py hands them to TRL's get_dataset.
        self.datasets = [d if isinstance(d, dict) else dataclasses.asdict(d) for d in self.datasets or []]
        for flag in ("streaming", "dataset_streaming"):
            if getattr(self, flag) and self.max_steps <= 0:
                raise ConfigError(f"--{flag}: give --max_steps: a streamed dataset has no length to count epochs by")
        if self.device_type == "auto":
            import torch

            self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device_type == "cpu":
            # (what the user turned on, said by check_inputs; not a field: not written with the config)
            self._mixed_precision_off = [f"--{name}" for name in ("bf16", "fp16") if getattr(self, name)]
            self.use_cpu, self.bf16, self.fp16 = True, False, False  # GRPOConfig's bf16 default needs a GPU
        checks = {
            "device_type": (self.device_type in ("cpu", "cuda"), "must be cpu, cuda or auto"),
            "consume_order": (self.consume_order in ("ready", "fifo"), "must be ready or fifo"),
            "off_policy_correction": (self.off_policy_correction in OFF_POLICY_MODES,
                                      f"must be one of {', '.join(OFF_POLICY_MODES)}"),
            "off_policy_cap": (self.off_policy_cap > 0, "must be > 0"),
            "dynamic_sampling_max_std": (self.dynamic_sampling_max_std >= 0, "must be >= 0"),
            "difficulty_filter": (self.difficulty_filter >= 0, "must be >= 0 (0: off)"),
            "difficulty_filter_wait": (self.difficulty_filter_wait >= 1, "must be >= 1"),
            "tool_timeout_s": (self.tool_timeout_s >= 0, "must be >= 0 (0: no limit)"),
            "weight_transport": (self.weight_transport in WEIGHT_TRANSPORTS,
                                 f"must be {', '.join(WEIGHT_TRANSPORTS[:-1])} or {WEIGHT_TRANSPORTS[-1]}"),
            "ps_processes": (self.ps_processes >= 1, "must be >= 1"),
            "worker_decoding": (self.worker_decoding in WORKER_DECODING_MODES,
                                "must be one of " + ", ".join(WORKER_DECODING_MODES)),
            # (transformers takes any max_steps <= 0 as "train --num_train_epochs": 0 trained one step, -5 three epochs)
            "max_steps": (self.max_steps >= 1 or self.max_steps == -1,
                          "must be >= 1 (or -1, TRL's default: --num_train_epochs sets the length)"),
            "jobs_per_generate": (self.jobs_per_generate >= 1, "must be >= 1"),
            "max_pending": (self.max_pending >= 1, "must be >= 1"),
            "max_outstanding": (self.max_outstanding >= 1, "must be >= 1"),
            "max_staleness": (self.max_staleness >= 0, "must be >= 0"),
            "lease_s": (self.lease_s > 0, "must be > 0"),
            "max_attempts": (self.max_attempts >= 1, "must be >= 1"),
            "job_timeout_s": (self.job_timeout_s >= 0, "must be >= 0 (0: no deadline)"),
            "archive_keep_files": (self.archive_keep_files >= 0, "must be >= 0 (0 keeps all)"),
            "archive_keep_mb": (self.archive_keep_mb >= 0, "must be >= 0 (0 keeps all)"),
            "max_payload_mb": (self.max_payload_mb >= 0, "must be >= 0 (0: derived from the batch shape)"),
        }
        for name, (ok, why) in checks.items():
            if not ok:
                raise ConfigError(f"--{name} {getattr(self, name)!r}: {why}")
        if self.use_vllm:
            # TRL pushes weights into vLLM when its global_step changes, which a worker sets from the job's PS step,
            # not from the weights it synced: results would claim weights they were not generated with.
            raise ConfigError("--use_vllm: asyncgrpo's workers generate with their own decoding engine "
                              "(--worker_decoding: graph, or continuous batching), not vLLM")
        if self.resume_from_checkpoint:
            raise ConfigError(f"--resume_from_checkpoint {self.resume_from_checkpoint}: a run resumes from its own "
                              "newest checkpoint when relaunched with the same --run_dir; to start a new run from a "
                              "checkpoint's weights, give its folder as --model_name_or_path")
        if self.sync_ref_model:
            # TRL's callback would mix the PS's reference model, which nothing reads: the workers score --beta's KL
            # against their own copy of the initial model.
            raise ConfigError("--sync_ref_model: not with asyncgrpo: the workers compute the reference log-probs "
                              "with their own copy of the initial model, which the parameter server's updates of "
                              "the reference would not reach")
        if self.worker_dtype is not None and self.use_peft and self.worker_dtype != self.dtype:
            raise ConfigError(f"--worker_dtype {self.worker_dtype} with --use_peft: the workers' base model is the "
                              "parameter server's, loaded in --dtype; give --dtype instead")
        mixed_precision = bool(self.fp16) or self.bf16 is not False  # GRPOConfig: bf16 unless fp16 or set off
        if problem := self.peft_args_problem(self.device_type, mixed_precision):
            raise ConfigError(problem)
        super().__post_init__()  # parses --model_init_kwargs '{...}' into a dict
        job_rows = self.generation_batch_size * self.ps_processes
        if self.decoding_slots and self.decoding_slots < job_rows:
            raise ConfigError(f"--decoding_slots {self.decoding_slots}: must be 0 (automatic) or at least one job's "
                              f"rows ({job_rows}: the generation batch of each PS process)")
        if not isinstance(self.model_init_kwargs, (dict, type(None))):
            raise ConfigError(f"--model_init_kwargs {self.model_init_kwargs!r}: expected a JSON object, "
                              "e.g. '{\"dtype\": \"bfloat16\"}'")
        if (self.steps_per_generation * self.num_iterations) % self.gradient_accumulation_steps:
            raise ConfigError(
                f"--steps_per_generation {self.steps_per_generation} x --num_iterations {self.num_iterations} must be "
                f"a multiple of --gradient_accumulation_steps {self.gradient_accumulation_steps}: asyncgrpo trains "
                "each generated batch for whole optimizer steps")
        fsdp_version = (self.fsdp_plugin_args or {}).get("fsdp_version")
        if fsdp_version is not None and self.ps_processes == 1:
            raise ConfigError("--fsdp shards the PS's model across its processes: give it several (launch.sh "
                              "--ps-procs K, or --ps_processes K under torchrun)")
        if fsdp_version not in (None, 2):
            raise ConfigError(f"--fsdp_config version {fsdp_version}: asyncgrpo publishes the weights of FSDP2 "
                              "only (version 2, the default)")

    @property
    def max_payload_bytes(self) -> int:
        """The cap on a job or result file (--max_payload_mb, or derived from the batch shape)."""
        if self.max_payload_mb > 0:
            return int(self.max_payload_mb * 1e6)
        rows = self.generation_batch_size * self.ps_processes
        return (64 << 20) + rows * (self.max_completion_length + 4096) * 64

    @property
    def steps_per_job(self) -> int:
        """Optimizer steps one job (one generation batch) trains: TRL splits it into steps_per_generation
        micro-batches and goes over them num_iterations times."""
        return self.steps_per_generation * self.num_iterations // self.gradient_accumulation_steps

    def generation_settings(self) -> dict:
        """This config's GENERATION_FLAGS, as JSON values (what a job carries)."""
        return json.loads(json.dumps({name: getattr(self, name) for name in GENERATION_FLAGS}, default=str))

    def generation_mismatch(self, theirs: dict | None) -> str | None:
        """How this config's generation settings differ from ``theirs`` (the running PS's), as one line for a
        ConfigError; None when they agree (or there are none to compare with)."""
        if not theirs:
            return None
        mine = self.generation_settings()

        def said(value) -> str:
            return "not given" if value is None else repr(value)

        differ = [f"--{name} {said(mine.get(name))} (the parameter server's: {said(theirs[name])})"
                  for name in GENERATION_FLAGS if name in theirs and mine.get(name) != theirs[name]]
        if not differ:
            return None
        return (f"this worker's flags are not the parameter server's: {', '.join(differ)}; start it with the "
                "parameter server's config flags")
