"""The model, tokenizer, dataset and reward functions a config names, or a one-line ConfigError.

``check_inputs(cfg)`` is the cheap version that launch.sh runs before starting anything:
it imports the reward functions and checks that local paths exist and the run directory
is writable, without loading a model.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from asyncgrpo.config import AsyncGRPOConfig, ConfigError

DEMO_MODEL_DIR = "demo_model"  # inside the run directory, written by the PS for its workers


def _looks_like_a_path(name: str) -> bool:
    """A hub id is 'name' or 'org/name'; anything else that is not on disk is a missing path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith((".jsonl", ".json", ".parquet"))


def load_reward_funcs(cfg: AsyncGRPOConfig) -> list[Callable]:
    if cfg.is_demo or not cfg.reward_funcs:
        from asyncgrpo.tasks.demo import repeat_digit_reward

        if not cfg.reward_funcs:
            return [repeat_digit_reward]
    funcs = []
    for spec in cfg.reward_funcs:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"--reward_funcs {spec!r}: expected 'module:function'")
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # any import-time failure of user code is a bad input
            raise ConfigError(f"--reward_funcs {spec!r}: cannot import {module_name}: {err}") from None
        func = getattr(module, attr, None)
        if not callable(func):
            raise ConfigError(f"--reward_funcs {spec!r}: {module_name} has no function {attr}")
        funcs.append(func)
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(funcs):
        raise ConfigError(f"--reward_weights has {len(cfg.reward_weights)} values for {len(funcs)} reward functions")
    return funcs


def load_train_dataset(cfg: AsyncGRPOConfig):
    import datasets

    if cfg.dataset_name is None:
        from asyncgrpo.tasks.demo import build_dataset

        return build_dataset(seed=cfg.seed)
    name = os.path.expanduser(cfg.dataset_name)
    try:
        if os.path.isdir(name):
            loaded = datasets.load_from_disk(name)
        elif os.path.isfile(name):
            kind = "parquet" if name.endswith(".parquet") else "json"
            loaded = datasets.load_dataset(kind, data_files=name)
        elif _looks_like_a_path(name):
            raise ConfigError(f"--dataset_name {cfg.dataset_name}: no such file or folder")
        else:
            loaded = datasets.load_dataset(name)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"--dataset_name {cfg.dataset_name}: cannot load: {str(err).splitlines()[0]}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if cfg.dataset_split not in loaded:
            raise ConfigError(f"--dataset_name {cfg.dataset_name}: no split {cfg.dataset_split!r} "
                              f"(has {', '.join(loaded)})")
        loaded = loaded[cfg.dataset_split]
    if "prompt" not in loaded.column_names:
        raise ConfigError(f"--dataset_name {cfg.dataset_name}: no 'prompt' column (has {loaded.column_names})")
    return loaded


def model_path(cfg: AsyncGRPOConfig, run_root: str | os.PathLike) -> str:
    """Where the model comes from: the config's, or the demo model the PS writes into the run."""
    if cfg.model_name_or_path is None:
        return str(Path(run_root) / DEMO_MODEL_DIR)
    return os.path.expanduser(cfg.model_name_or_path)


def write_demo_model_once(run_root: str | os.PathLike) -> str:
    """The PS writes the demo model into the run once (tmp folder + rename: all or nothing)."""
    from asyncgrpo.tasks.demo import write_demo_model

    target = Path(run_root) / DEMO_MODEL_DIR
    if not target.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".demo_model.", dir=run_root))
        write_demo_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # a concurrent writer won (cannot happen with one PS per run, but harmless)
            pass
    return str(target)


def load_model_and_tokenizer(path: str, **model_kwargs):
    """``model_kwargs`` go to ``from_pretrained`` (QLoRA: ``cfg.model_load_kwargs()``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path, **model_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise ConfigError(f"--model_name_or_path {path}: cannot load: {str(err).splitlines()[0]}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def check_inputs(cfg: AsyncGRPOConfig, run_root: str | os.PathLike) -> None:
    """Everything launch.sh can check before a process starts (ConfigError otherwise)."""
    load_reward_funcs(cfg)
    if cfg.model_name_or_path is not None:
        name = os.path.expanduser(cfg.model_name_or_path)
        if not os.path.exists(name) and _looks_like_a_path(name):
            raise ConfigError(f"--model_name_or_path {cfg.model_name_or_path}: no such folder")
        if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(f"--model_name_or_path {cfg.model_name_or_path}: no config.json in that folder")
    if cfg.dataset_name is not None:
        name = os.path.expanduser(cfg.dataset_name)
        if not os.path.exists(name) and _looks_like_a_path(name):
            raise ConfigError(f"--dataset_name {cfg.dataset_name}: no such file or folder")
    root = Path(run_root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=root, prefix=".write_probe.")
        probe.close()
    except OSError as err:
        raise ConfigError(f"--run_dir {root}: not writable: {err.strerror or err}") from None
