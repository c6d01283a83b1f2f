"""What launch.sh checks before any process starts (``python -m ps --check_only``): ``check_inputs(cfg)``
imports the reward functions, reads the model's config and tokenizer (not its weights), loads the datasets
and checks their splits and 'prompt' column, and checks that the run directory is writable and outside the
source tree. Each problem is a one-line ConfigError; what is merely worth saying comes back as notes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from asyncgrpo.config import AsyncGRPOConfig, ConfigError
from asyncgrpo.inputs import (
    SOURCE_TREE,
    half_dtype_note,
    load_eval_dataset,
    load_reward_funcs,
    load_train_dataset,
    looks_like_a_path,
    model_load_kwargs,
)
from asyncgrpo.messages import first_line
from asyncgrpo.run import RunDir
from asyncgrpo.run.checkpoints import damaged_newest
from asyncgrpo.user_code import load_rollout_hooks

HUB_TIMEOUT_S = 10.0


def _check_hub_model(name: str, revision: str | None) -> None:
    """A hub id: in the local Hugging Face cache, or on a hub that answers one request. transformers would retry an
    unreachable hub 5 times over half a minute, with two log lines a try, before the same refusal."""
    from huggingface_hub import constants, model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, revision=revision, local_files_only=True)
        return  # cached: loads without the network (the tokenizer and weights are checked next)
    except Exception:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"--model_name_or_path {name}: not a local folder, and not in the Hugging Face cache "
                          "(HF_HUB_OFFLINE is set)") from None
    try:
        model_info(name, revision=revision, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return  # it exists; the load says what access it needs
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise ConfigError(f"--model_name_or_path {name}: not a local folder, and not on the Hugging Face hub "
                          f"({first_line(err, with_type=False)})") from None
    except Exception as err:
        raise ConfigError(f"--model_name_or_path {name}: not a local folder, not in the Hugging Face cache, and the "
                          f"hub cannot be reached ({first_line(err)}): download it where the hub can be reached "
                          "(hf download), or give a local folder") from None


def _check_tool_calling(cfg: AsyncGRPOConfig, tokenizer, model: str) -> None:
    """With tools, TRL refuses a chat template that cannot render a tool call when it builds the trainer, after the
    processes started: refused here, before."""
    from trl.chat_template_utils import supports_tool_calling

    if (cfg.tools or cfg.environment_factory) and not supports_tool_calling(tokenizer):
        flag = f"--tools {' '.join(cfg.tools)}" if cfg.tools else f"--environment_factory {cfg.environment_factory}"
        raise ConfigError(f"{flag}: the chat template of {model} cannot call tools (TRL needs one that renders a "
                          "user turn, an assistant turn with tool_calls and a tool turn): give a "
                          "--model_name_or_path whose template can, or use --builtin_task lookup's model")


def _check_model(cfg: AsyncGRPOConfig, dataset, tools: list, eval_dataset=None) -> str | None:
    """Config and tokenizer load, weights are there (not loaded), the prompts of both splits fit; returns a note for
    the user or None."""
    from transformers import AutoConfig, AutoTokenizer

    name = os.path.expanduser(cfg.model_name_or_path)
    if not os.path.exists(name) and looks_like_a_path(name):
        raise ConfigError(f"--model_name_or_path {cfg.model_name_or_path}: no such folder")
    if os.path.isfile(name):
        raise ConfigError(f"--model_name_or_path {cfg.model_name_or_path}: a file, not a model's folder: give the "
                          "folder that holds its config.json, weights and tokenizer" + (
                              " (a GGUF file: load it once with transformers' from_pretrained(folder, gguf_file=...) "
                              "and save the model and its tokenizer with save_pretrained)" if name.endswith(".gguf")
                              else ""))
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(f"--model_name_or_path {cfg.model_name_or_path}: no config.json in that folder")
        if not any(next(Path(name).glob(pattern), None) for pattern in ("*.safetensors", "*.bin")):
            raise ConfigError(f"--model_name_or_path {cfg.model_name_or_path}: no weights (*.safetensors, *.bin) "
                              "in that folder")
    kwargs = model_load_kwargs(cfg)
    where = {"revision": kwargs.get("revision"), "trust_remote_code": kwargs.get("trust_remote_code", False)}
    if not os.path.isdir(name):
        _check_hub_model(cfg.model_name_or_path, where["revision"])
    try:
        config = AutoConfig.from_pretrained(name, **where)
    except Exception as err:
        raise ConfigError(f"--model_name_or_path {cfg.model_name_or_path}: bad config: "
                          f"{first_line(err, with_type=False)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **where)
    except Exception as err:
        raise ConfigError(f"--model_name_or_path {cfg.model_name_or_path}: cannot load its tokenizer: "
                          f"{first_line(err, with_type=False)}") from None
    try:
        empty = len(tokenizer) <= 1  # (transformers makes some models' tokenizer class without files: empty, no error)
    except Exception:  # (a remote code tokenizer without a length: not for this check to say)
        empty = False
    if empty:
        raise ConfigError(f"--model_name_or_path {cfg.model_name_or_path}: no tokenizer in that folder (its files, "
                          "tokenizer.json or the vocabulary, are not there): save the tokenizer with the model "
                          "(tokenizer.save_pretrained)")
    _check_tool_calling(cfg, tokenizer, cfg.model_name_or_path)
    # (the evaluation's prompts too: a prompt too long for learned positions fails the first evaluation, mid-run)
    lengths_notes = [_check_lengths(cfg, config, tokenizer, dataset, tools)]
    if eval_dataset is not None:
        lengths_notes.append(_check_lengths(cfg, config, tokenizer, eval_dataset, tools, split=cfg.dataset_test_split))
    dtype = config.dtype if kwargs.get("dtype") == "auto" else kwargs.get("dtype")
    return "; ".join(note for note in (half_dtype_note(dtype, cfg.device_type)[0], *lengths_notes) if note) or None


PROMPTS_MEASURED = 1024  # the dataset's first rows whose prompts are measured against the model's positions


def _check_lengths(cfg: AsyncGRPOConfig, config, tokenizer, dataset, tools: list, split: str | None = None
                   ) -> str | None:
    """A prompt of the dataset's first rows plus ``max_completion_length`` tokens beyond the model's positions
    (``max_position_embeddings``): refused for a model with learned positions (it cannot encode them), a note for
    one with rotary positions (it decodes positions it was not trained on). Conversations need a chat template.
    ``split``: the evaluation's (named in the lines), not the training's."""
    import itertools

    rows = list(itertools.islice(dataset, PROMPTS_MEASURED))
    source = f"--dataset_name {cfg.dataset_name}" if cfg.dataset_name else "the dataset"
    if split is not None:
        source += f", its {split!r} split (--dataset_test_split, evaluated)"
    for i, row in enumerate(rows):
        if isinstance(row, dict) and not isinstance(row.get("prompt"), (str, list)):  # (a JSON line without one: None)
            raise ConfigError(f"{source}: row {i + 1} (counting from 1): its prompt is {row.get('prompt')!r}, not a "
                              f"text or a conversation (a list of role/content messages)")
    talks = [isinstance(row.get("prompt"), list) for row in rows if isinstance(row, dict)]  # (rows are dicts)
    if (odd := next((i for i, talk in enumerate(talks) if talk != talks[0]), None)) is not None:
        kind = {True: "a conversation", False: "a text"}  # (TRL takes a batch's prompts all one way, from its first)
        raise ConfigError(f"{source}: row {odd + 1} (counting from 1): its prompt is {kind[talks[odd]]}, and row 1's "
                          f"{kind[talks[0]]}: TRL takes a dataset's prompts all as texts, or all as conversations "
                          "(lists of role/content messages)")
    if any(talks) and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{source}: its prompts are conversations (lists of role/content messages), and the "
                          f"tokenizer of {cfg.model_name_or_path} has no chat template to turn them into tokens: give "
                          "a --model_name_or_path whose tokenizer has one (a chat or instruct model), or plain-text "
                          "prompts")
    lengths = [prompt_tokens(cfg, tokenizer, row.get("prompt"), tools) if isinstance(row, dict) else 1 for row in rows]
    if 0 in lengths:
        row = lengths.index(0)
        raise ConfigError(f"{source}: row {row + 1} (counting from 1): its prompt {rows[row].get('prompt')!r:.40} has "
                          f"no token in {cfg.model_name_or_path}'s tokenizer: nothing to generate from")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not positions:
        return
    longest = max(lengths, default=0)
    if longest + cfg.max_completion_length <= positions:
        return None
    where = f" ({source})" if split is not None else ""
    beyond = (f"--max_completion_length {cfg.max_completion_length}: prompts of up to {longest} tokens{where} plus "
              f"{cfg.max_completion_length} completion tokens exceed the {positions} positions of "
              f"{cfg.model_name_or_path} (its max_position_embeddings)")
    rotary = any(getattr(config, name, None) for name in ("rope_parameters", "rope_theta", "rope_scaling"))
    if not rotary:
        raise ConfigError(f"{beyond}: shorten the prompts or --max_completion_length")
    return f"{beyond}: its rotary positions go on beyond them, untrained"


def prompt_tokens(cfg: AsyncGRPOConfig, tokenizer, prompt, tools: list) -> int:
    """The tokens a worker feeds the model for ``prompt``, tokenised as TRL's ``_tokenize_prompts`` does: plain
    text as the tokenizer encodes it, a conversation through its chat template with the run's tools and
    ``--chat_template_kwargs`` (whatever mapping the tokenizer returns: a ``BatchEncoding`` is no ``dict``)."""
    if isinstance(prompt, str):
        return len(tokenizer(text=prompt)["input_ids"])
    if not isinstance(prompt, list):
        return 0
    encoded = tokenizer.apply_chat_template(conversation=[prompt], tools=tools or None, add_generation_prompt=True,
                                            tokenize=True, return_dict=True, **(cfg.chat_template_kwargs or {}))
    return len(encoded["input_ids"][0])


# ---------------------------------------------------------------------- all of it, before anything starts

REPORT_TO_EXTRAS = ("tensorboard", "wandb", "trackio")  # asyncgrpo's extras of that name (pyproject.toml)


def check_report_to(cfg: AsyncGRPOConfig) -> None:
    """Each --report_to integration importable, as transformers will need it when training starts."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    available = get_available_reporting_integrations()
    for name in cfg.report_to or []:
        if name in ("none", "all") or name in available:
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            raise ConfigError(f"--report_to {name}: not an integration transformers knows (one of "
                              f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}, or none)")
        how = _pip_install(name) if name in REPORT_TO_EXTRAS else f"install the {name} package into {Path(sys.prefix)}"
        raise ConfigError(f"--report_to {name}: {name} is not installed: {how}")


def _pip_install(package: str) -> str:
    pip = Path(sys.executable).with_name("pip")  # this environment's (launch.sh's .venv/bin/pip)
    return f"{pip if pip.exists() else 'pip'} install {package}"


def _ignored_vllm_flags(cfg: AsyncGRPOConfig) -> str | None:
    """TRL's --vllm_* flags, each set off its default: they do nothing here (--use_vllm itself is refused)."""
    import dataclasses

    ignored = [f"--{f.name}" for f in dataclasses.fields(cfg) if f.name.startswith("vllm_")
               and f.default is not dataclasses.MISSING and getattr(cfg, f.name) != f.default]
    if ignored:
        return (f"{', '.join(ignored)}: ignored: asyncgrpo's workers generate with their own decoding engine "
                "(--worker_decoding), not vLLM")
    return None


# What TRL's _calculate_rewards passes every reward function besides the dataset's other columns.
REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def _check_reward_arguments(cfg: AsyncGRPOConfig, funcs: list, dataset, environment: bool) -> None:
    """Each reward function takes what TRL passes it, by keyword: a parameter without a default that names no column
    of the dataset failed every job (and the run, after --max_failed_in_a_row of them); one without ``**kwargs`` fails
    on the columns it does not name. (A --rollout_func passes its output's fields too, which only a rollout tells.)"""
    import inspect

    from torch import nn

    first = next(iter(dataset), None)
    if not isinstance(first, dict):
        return
    columns = [key for key in first if key not in ("prompt", "completion", "completion_ids")]
    passed = {*REWARD_KEYWORDS, *columns, *(["environments"] if environment else [])}
    source = f"--dataset_name {cfg.dataset_name}" if cfg.dataset_name else "the dataset"
    for func in funcs:
        if not callable(func) or isinstance(func, nn.Module):  # (a reward model: TRL calls it on token ids)
            continue
        try:  # (the signature TRL calls: a decorator's wrapper, not the function it wraps)
            params = inspect.signature(func, follow_wrapped=False).parameters.values()
        except (TypeError, ValueError):  # (a builtin: nothing to read)
            continue
        name = getattr(func, "__name__", type(func).__name__)
        required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if positional := [p.name for p in required if p.kind is p.POSITIONAL_ONLY]:
            raise ConfigError(f"--reward_funcs: {name} takes {', '.join(positional)} by position only, and TRL passes "
                              "every argument by keyword: drop the '/' from its parameters")
        needed = [p.name for p in required if p.name not in passed]
        if needed and not cfg.rollout_func:
            where = (f"{source} has none of that name (its columns: {', '.join(['prompt', *columns])})"
                     + ("; TRL passes environments only with --environment_factory" if "environments" in needed
                        else ""))
            raise ConfigError(f"--reward_funcs: {name} needs {', '.join(repr(n) for n in needed)}, which TRL passes "
                              f"only as a column of the dataset, and {where}")
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            if unnamed := sorted(passed - {p.name for p in params}):
                raise ConfigError(f"--reward_funcs: {name} takes no **kwargs, and TRL passes every reward function "
                                  f"{', '.join(unnamed)} as well: add **kwargs to its parameters")


def check_inputs(cfg: AsyncGRPOConfig, run_root: str | os.PathLike) -> list[str]:
    """Everything launch.sh can check before a process starts (ConfigError otherwise). Returns notes
    for the user (one line each)."""
    notes = []
    check_report_to(cfg)
    if cfg.use_liger_kernel:
        from transformers.utils import is_liger_kernel_available

        if not is_liger_kernel_available():
            raise ConfigError(f"--use_liger_kernel: the liger-kernel package is not installed: "
                              f"{_pip_install('liger-kernel')} (its kernels run on a GPU)")
    hooks = load_rollout_hooks(cfg)
    reward_funcs = load_reward_funcs(cfg)
    if not reward_funcs and not callable(getattr(hooks.environment_factory, "get_reward", None)):
        raise ConfigError(f"--environment_factory {cfg.environment_factory}: no get_reward method, and no "
                          "--reward_funcs: nothing would score the rollouts")
    dataset = load_train_dataset(cfg)
    _check_reward_arguments(cfg, reward_funcs, dataset, hooks.environment_factory is not None)
    notes.append(_ignored_vllm_flags(cfg))
    if (off := getattr(cfg, "_mixed_precision_off", None)) and "16" not in str(cfg.dtype):  # (else: half_dtype_note)
        notes.append(f"{' '.join(off)}: mixed precision is off on CPU: the model computes in its --dtype, {cfg.dtype} "
                     "(--dtype bfloat16 runs it in bfloat16)")
    eval_dataset = load_eval_dataset(cfg)
    if cfg.model_name_or_path is not None:
        notes.append(_check_model(cfg, dataset, hooks.tools, eval_dataset))
    else:
        from asyncgrpo.tasks import demo, lookup

        if cfg.dataset_name or cfg.datasets or cfg.reward_funcs:  # so the task's own settings were not applied
            notes.append(f"no --model_name_or_path: training the built-in {cfg.builtin_task!r} task's tiny model, "
                         f"with TRL's defaults for what you did not set (learning_rate {cfg.learning_rate:g}, "
                         f"max_steps {cfg.max_steps}, ...), not the task's own; give --model_name_or_path for "
                         "your model")
        if cfg.tools or cfg.environment_factory:
            task = lookup if cfg.builtin_task == "lookup" else demo
            _check_tool_calling(cfg, task.build_tokenizer(), f"the built-in {cfg.builtin_task!r} task's model")
        if cfg.dtype != "auto":
            notes.append(half_dtype_note(cfg.dtype, cfg.device_type)[0])
    if cfg.fsdp_plugin_args and cfg.device_type == "cpu":
        notes.append("--fsdp: accelerate shards a model on GPUs only; on CPU every PS process holds the whole model")
    root = Path(os.path.abspath(os.path.expanduser(run_root)))
    if (SOURCE_TREE / "pyproject.toml").is_file() and root.is_relative_to(SOURCE_TREE):
        raise ConfigError(f"--run_dir {root}: inside the source tree {SOURCE_TREE}; choose a folder outside it")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=root, prefix=".write_probe.")
        probe.close()
    except OSError as err:
        raise ConfigError(f"--run_dir {root}: not writable: {err.strerror or err}") from None
    if (refusal := damaged_newest(RunDir(root).checkpoints)) is not None:  # (a relaunch: before any process starts)
        raise ConfigError(refusal)
    return [note for note in notes if note]
