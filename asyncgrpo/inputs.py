"""The model, tokenizer, datasets and reward functions a config names, or a one-line ConfigError.

asyncgrpo/checks.py ``check_inputs`` is the cheap check that launch.sh runs before starting anything.

Relative paths are relative to the current folder (launch.sh runs every process in the
folder it was started from), and reward modules import from it, as they would with
``python`` or ``trl grpo``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from asyncgrpo.config import AsyncGRPOConfig, ConfigError
from asyncgrpo.messages import first_line
from asyncgrpo.run.rundir import RunDir
from asyncgrpo.user_code import import_callable

SOURCE_TREE = Path(__file__).resolve().parents[1]  # the checkout (or site-packages) holding asyncgrpo/
HALF_DTYPES = ("bfloat16", "float16")

log = logging.getLogger("asyncgrpo.inputs")


def looks_like_a_path(name: str) -> bool:
    """A hub id is 'name' or 'org/name'; anything else that is not on disk is a missing path."""
    return (name.startswith(("/", ".", "~")) or name.count("/") > 1
            or name.endswith((".jsonl", ".json", ".parquet", ".csv")))


# ---------------------------------------------------------------------- reward functions

def _trl_reward(name: str) -> Callable | None:
    """The reward functions `trl grpo --reward_funcs NAME` knows by name, built as it builds them."""
    from trl import rewards

    named = {"accuracy_reward": lambda: rewards.accuracy_reward,
             "reasoning_accuracy_reward": lambda: rewards.reasoning_accuracy_reward,
             "think_format_reward": lambda: rewards.think_format_reward,
             "get_soft_overlong_punishment": lambda: rewards.get_soft_overlong_punishment(
                 max_completion_len=1280, soft_punish_cache=256)}
    return named[name]() if name in named else None


def load_reward_funcs(cfg: AsyncGRPOConfig) -> list[Callable | str]:
    """The rewards as TRL's GRPOTrainer takes them: a reward model first (--reward_model_name_or_path, as trl grpo
    puts it), then each of --reward_funcs: ``module:function``, TRL's ``module.function``, a reward TRL names
    (accuracy_reward, ...), or a reward model's folder or ``org/name`` hub id. A reward model stays a string:
    GRPOTrainer loads it (a sequence classifier with one label) where it runs. Without any, the built-in task's
    reward."""
    models = [_reward_model(cfg.reward_model_name_or_path, "--reward_model_name_or_path")] \
        if cfg.reward_model_name_or_path else []
    if not cfg.reward_funcs and not models:
        if cfg.environment_factory:  # the environment scores (its get_reward), as in TRL
            return []
        if cfg.builtin_task == "lookup":
            from asyncgrpo.tasks.lookup import lookup_reward

            return [lookup_reward]
        from asyncgrpo.tasks.demo import first_digit_reward, repeat_digit_reward

        return [first_digit_reward if cfg.builtin_task == "first_digit" else repeat_digit_reward]
    funcs = models + [_reward_model(spec, "--reward_funcs") if _names_a_model(spec) else _reward_func(spec)
                      for spec in cfg.reward_funcs or []]
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(funcs):
        raise ConfigError(f"--reward_weights has {len(cfg.reward_weights)} values for {len(funcs)} rewards")
    return funcs


def _names_a_model(spec: str) -> bool:
    """A folder, or a hub id ``org/name`` (an import path has no slash)."""
    return ":" not in spec and (os.path.isdir(os.path.expanduser(spec)) or "/" in spec)


def _reward_model(spec: str, flag: str) -> str:
    """A reward model's folder (absolute: every process loads it) after reading its config, or a hub id as given."""
    path = os.path.abspath(os.path.expanduser(spec))
    if not os.path.isdir(path):
        if looks_like_a_path(spec):
            raise ConfigError(f"{flag} {spec}: no such folder")
        return spec  # a hub id: TRL downloads it, as trl grpo does
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{flag} {spec}: no config.json in {path} (a model saved with save_pretrained)")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path)
    except Exception as err:  # a user's file: any failure to read it is a bad input
        raise ConfigError(f"{flag} {spec}: cannot read its config: {first_line(err)}") from None
    return path


def _reward_func(spec: str) -> Callable:
    if ":" not in spec and (func := _trl_reward(spec)) is not None:
        return func
    return import_callable(spec, "--reward_funcs")


# ---------------------------------------------------------------------- datasets

def _load_dataset(cfg: AsyncGRPOConfig):
    """--dataset_name as a Dataset or DatasetDict: a file, a save_to_disk folder, or what
    ``datasets.load_dataset`` loads (a folder of split files, a hub id), as trl grpo loads it."""
    import datasets

    if cfg.datasets:  # TRL's mixture, loaded as trl grpo loads it (it wins over --dataset_name there too)
        import numpy as np
        from trl import DatasetMixtureConfig, get_dataset

        # get_dataset's train/test split draws from numpy's global generator: seeded here, every load (the train
        # and the test split, the PS and each worker) makes the same split.
        saved = np.random.get_state()
        np.random.seed(cfg.seed)
        try:
            return get_dataset(DatasetMixtureConfig(datasets=[dict(d) for d in cfg.datasets], streaming=streams(cfg),
                                                    test_split_size=cfg.test_split_size))
        except Exception as err:
            raise ConfigError(f"--datasets: cannot load the mixture: {first_line(err, with_type=False)}") from None
        finally:
            np.random.set_state(saved)
    name = os.path.expanduser(cfg.dataset_name)
    try:
        if os.path.isfile(name):
            kind = {".parquet": "parquet", ".csv": "csv"}.get(Path(name).suffix, "json")
            # (its JSON builder logs pyarrow's error before raising it: the one line below says it, once)
            json_log = logging.getLogger("datasets.packaged_modules.json.json")
            level = json_log.level
            json_log.setLevel(logging.CRITICAL)
            try:
                return datasets.load_dataset(kind, data_files=name, streaming=streams(cfg))
            finally:
                json_log.setLevel(level)
        if os.path.isdir(name) and any(Path(name, f).exists() for f in ("dataset_dict.json", "state.json")):
            return _streamed_if_asked(cfg, datasets.load_from_disk(name))
        if not os.path.isdir(name) and looks_like_a_path(name):
            raise ConfigError(f"--dataset_name {cfg.dataset_name}: no such file or folder")
        return datasets.load_dataset(name, name=cfg.dataset_config, streaming=streams(cfg))
    except ConfigError:
        raise
    except StopIteration:  # how datasets' file loaders say a file holds no rows
        raise ConfigError(f"--dataset_name {cfg.dataset_name}: the dataset is empty (no rows)") from None
    except Exception as err:
        reason = _first_bad_line(name) if name.endswith(".jsonl") else None
        if reason is None:
            reason = first_line(err, with_type=False)
            # (datasets' "An error occurred while generating the dataset" says nothing of its cause)
            cause = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
            if cause is not None:
                reason += f": {first_line(cause, with_type=False)}"
        raise ConfigError(f"--dataset_name {cfg.dataset_name}: cannot load: {reason}") from None


def _first_bad_line(path: str) -> str | None:
    """Where a JSON Lines file is not JSON: its first such line, counted from 1 (pyarrow's reader counts rows within
    each block it reads, from 0), or None."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        json.loads(line.rstrip("\r\n"))  # (its column, not the next line's first)
                    except json.JSONDecodeError as err:
                        return f"line {number} is not JSON ({err.msg}, at column {err.colno})"
    except (OSError, UnicodeDecodeError) as err:
        return first_line(err, with_type=False)
    return None


def streams(cfg: AsyncGRPOConfig) -> bool:
    """--dataset_streaming (TRL's flag for --dataset_name) or --streaming (its mixture's): either streams the data."""
    return bool(cfg.dataset_streaming or cfg.streaming)


def _streamed_if_asked(cfg: AsyncGRPOConfig, loaded):
    """A dataset held whole (a save_to_disk folder, a built-in task's) as a stream when streaming is asked for."""
    import datasets

    if not streams(cfg):
        return loaded
    if isinstance(loaded, datasets.DatasetDict):
        return datasets.IterableDatasetDict({name: split.to_iterable_dataset() for name, split in loaded.items()})
    return loaded.to_iterable_dataset()


def _source(cfg: AsyncGRPOConfig) -> str:
    """The dataset as the user named it, for messages."""
    return "--datasets (the mixture)" if cfg.datasets else f"--dataset_name {cfg.dataset_name}"


def _split(cfg: AsyncGRPOConfig, loaded, split: str, flag: str):
    import datasets

    if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in loaded:
            raise ConfigError(f"{flag} {split}: {_source(cfg)} has no split {split!r} (has {', '.join(loaded)})")
        loaded = loaded[split]
    columns = loaded.column_names
    if columns is None:  # a stream whose features are not declared: its first row says
        try:
            columns = list(next(iter(loaded)))
        except StopIteration:
            raise ConfigError(f"{_source(cfg)}: split {split!r} is empty (no rows)") from None
        except Exception as err:
            raise ConfigError(f"{_source(cfg)}: cannot read split {split!r}: {first_line(err, with_type=False)}") \
                from None
    if "prompt" not in columns:
        raise ConfigError(f"{_source(cfg)}: no 'prompt' column in split {split!r} (has {', '.join(columns)})")
    return loaded


def evaluates(cfg: AsyncGRPOConfig) -> bool:
    return cfg.eval_strategy != "no"


def _strategy(cfg: AsyncGRPOConfig) -> str:
    return getattr(cfg.eval_strategy, "value", cfg.eval_strategy)


def load_train_dataset(cfg: AsyncGRPOConfig):
    if cfg.dataset_name is None and not cfg.datasets and cfg.builtin_task == "lookup":
        from asyncgrpo.tasks.lookup import build_dataset as build_lookup_dataset

        return _streamed_if_asked(cfg, build_lookup_dataset(seed=cfg.seed))
    if cfg.dataset_name is None and not cfg.datasets:
        from asyncgrpo.tasks.demo import build_dataset

        return _streamed_if_asked(cfg, build_dataset(seed=cfg.seed))
    dataset = _split(cfg, _load_dataset(cfg), cfg.dataset_train_split, "--dataset_train_split")
    prompts = cfg.generation_batch_size // cfg.num_generations
    if sum(1 for _ in itertools.islice(dataset, prompts)) < prompts:  # (reads no further than that in a stream)
        raise ConfigError(f"{_source(cfg)}: fewer than {prompts} prompts in split {cfg.dataset_train_split!r}: not "
                          f"one generation batch ({cfg.generation_batch_size} rows, {cfg.num_generations} "
                          "generations each)")
    return dataset


def load_eval_dataset(cfg: AsyncGRPOConfig):
    """The split TRL evaluates on (--dataset_test_split) when --eval_strategy asks for evaluation, else None."""
    if not evaluates(cfg):
        return None
    if cfg.dataset_name is None and not cfg.datasets:
        raise ConfigError(f"--eval_strategy {_strategy(cfg)}: no evaluation data: the demo task has no "
                          "test split; give --dataset_name with a test split (--dataset_test_split)")
    loaded = _load_dataset(cfg)
    import datasets

    splits = (datasets.DatasetDict, datasets.IterableDatasetDict)
    if not isinstance(loaded, splits) or cfg.dataset_test_split not in loaded:
        has = ", ".join(loaded) if isinstance(loaded, splits) else "no splits"
        raise ConfigError(f"--eval_strategy {_strategy(cfg)}: no evaluation data: {_source(cfg)} has no split "
                          f"{cfg.dataset_test_split!r} (--dataset_test_split; it has {has})")
    return _split(cfg, loaded, cfg.dataset_test_split, "--dataset_test_split")


# ---------------------------------------------------------------------- model

def model_path(cfg: AsyncGRPOConfig, run_root: str | os.PathLike) -> str:
    """Where the model comes from: the config's (a local folder made absolute), or the built-in model in the run."""
    if cfg.model_name_or_path is None:
        return str(_builtin_model(cfg, RunDir(Path(run_root))))
    name = os.path.expanduser(cfg.model_name_or_path)
    return os.path.abspath(name) if os.path.isdir(name) else name


def _builtin_model(cfg: AsyncGRPOConfig | None, run: RunDir) -> Path:
    return run.lookup_model if cfg is not None and cfg.builtin_task == "lookup" else run.demo_model


def write_demo_model_once(run_root: str | os.PathLike, cfg: AsyncGRPOConfig | None = None) -> str:
    """The PS writes the built-in task's model into the run once (tmp folder + rename: all or nothing)."""
    from asyncgrpo.tasks.demo import write_demo_model
    from asyncgrpo.tasks.lookup import write_lookup_model

    target = _builtin_model(cfg, RunDir(Path(run_root)))
    if not target.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=run_root))
        (write_lookup_model if target.name == "lookup_model" else write_demo_model)(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # a concurrent writer won (cannot happen with one PS per run, but harmless)
            pass
    return str(target)


def model_load_kwargs(cfg: AsyncGRPOConfig | None) -> dict:
    """What ``trl grpo`` passes to ``from_pretrained``: the ModelConfig flags, overridden by --model_init_kwargs."""
    if cfg is None:
        return {"dtype": "float32"}  # ModelConfig's default
    kwargs = {"revision": cfg.model_revision, "trust_remote_code": cfg.trust_remote_code,
              "attn_implementation": cfg.attn_implementation, "dtype": cfg.dtype}
    kwargs.update(cfg.model_init_kwargs or {})
    if "torch_dtype" in kwargs:  # from_pretrained's older name
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    kwargs.update(cfg.quantization_kwargs())  # --load_in_4bit / --load_in_8bit (QLoRA)
    return kwargs


def half_dtype_note(dtype, device_type: str) -> tuple[str | None, object]:
    """(a note or None, the dtype to load in) for a requested dtype on this device.

    Every dtype is honoured on CPU (torch computes in bfloat16 and float16 there); a GPU
    without bfloat16 gets float32 instead."""
    import torch

    name = str(dtype).removeprefix("torch.")
    if name not in HALF_DTYPES:
        return None, dtype
    if device_type == "cpu":
        return (f"the model is {name} on CPU: it runs in {name} as asked (mixed precision, --bf16/--fp16, "
                "is off on CPU)"), dtype
    if name == "bfloat16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "this GPU has no bfloat16: the model is loaded in float32 instead", "float32"
    return None, dtype


class _ModelInitKwargsApplied(logging.Filter):
    """TRL warns that --model_init_kwargs are ignored when it is handed a loaded model: here they were applied."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`model_init_kwargs` will be ignored" not in record.getMessage()


_MODEL_INIT_KWARGS_APPLIED = _ModelInitKwargsApplied()


def load_model_and_tokenizer(path: str, cfg: AsyncGRPOConfig | None = None, dtype: str | None = None):
    """The model as ``trl grpo`` loads it (model_load_kwargs), or in ``dtype`` (a worker's --worker_dtype), and its
    tokenizer. Logs what it loaded.

    ``cfg.model_init_kwargs`` then says how the model was loaded (as trl grpo sets it), so that
    TRL's reference model (``--beta`` > 0) is loaded the same way, on one device.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    # The processes' logs are files: a loading bar's carriage returns would glue it to the next line of the log (and
    # of the terminal, which shows some of those lines).
    transformers_logging.disable_progress_bar()
    kwargs = model_load_kwargs(cfg)
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        dtype = kwargs.get("dtype")
        if dtype == "auto":  # as saved: the config's dtype, else transformers reads it off the weights
            dtype = AutoConfig.from_pretrained(path, revision=kwargs.get("revision"),
                                               trust_remote_code=kwargs.get("trust_remote_code", False)).dtype or "auto"
        note, kwargs["dtype"] = half_dtype_note(dtype, cfg.device_type if cfg else "cpu")
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, revision=kwargs.get("revision"),
                                                  trust_remote_code=kwargs.get("trust_remote_code", False))
    except Exception as err:
        raise ConfigError(f"--model_name_or_path {path}: cannot load: {first_line(err, with_type=False)}") from None
    if note:
        log.warning("[model] note: %s", note)
    if cfg is not None:
        # (Not the bitsandbytes config: it is no JSON, and a quantized base trains an adapter, whose reference
        # is the base with the adapter disabled, so TRL loads no reference model from these.)
        cfg.model_init_kwargs = {**{k: v for k, v in kwargs.items() if k != "quantization_config"},
                                 "dtype": str(model.dtype).removeprefix("torch."), "device_map": None,
                                 "attn_implementation": model.config._attn_implementation}
        logging.getLogger("trl.trainer.grpo_trainer").addFilter(_MODEL_INIT_KWARGS_APPLIED)
    log.info("[model] loaded %s: dtype=%s attn_implementation=%s", path, str(model.dtype).removeprefix("torch."),
             model.config._attn_implementation)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
