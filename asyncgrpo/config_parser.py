"""The command line and a ``--config`` YAML file into an AsyncGRPOConfig (asyncgrpo/config.py), with TRL's
``TrlParser``: one line (ConfigError) for a flag or YAML key that is not one, or a bad value; the built-in task's
defaults where the user gives no model, dataset or reward function.

    cfg = parse_config(["--max_steps", "200", "--reward_funcs", "mypkg.rewards:fn"])
"""

from __future__ import annotations

import re
import sys
import warnings

import yaml
from trl import TrlParser

from asyncgrpo import flag_check
from asyncgrpo.config import AsyncGRPOConfig, ConfigError
from asyncgrpo.messages import first_line


def _flag_value(argv: list[str], name: str, default=None):
    """The value given to ``--name`` on the command line (the last one wins, as in argparse), else ``default``."""
    value = default
    for i, word in enumerate(argv):
        if word == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(f"--{name}="):
            value = word.split("=", 1)[1]
    return value


def _flag_names(argv: list[str]) -> set[str]:
    return {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}


def _refuse_unknown_flags(argv: list[str], from_yaml: dict, config_path: str | None, parser) -> None:
    """ConfigError naming the first flag (or every key of the ``--config`` file) the parser does not know, with the
    flags it could be a typo or an abbreviation of."""
    known = {o for action in parser._actions for o in action.option_strings if o.startswith("--")} | {"--config"}
    flag_check.record(known)  # for the next launch's check before the heavy imports
    if (line := flag_check.unknown_flag(argv, known)) is not None:
        raise ConfigError(line)
    # The names TrlParser matches a YAML key against, and its env: section (variables it sets).
    fields = {action.dest for action in parser._actions} | {"env"}
    unknown = [f"{key}: not a config key" + flag_check.could_mean(str(key).replace("-", "_"), sorted(fields))
               for key in from_yaml if key not in fields]
    if unknown:  # (all of them: a file is edited once for all)
        raise ConfigError(f"--config {config_path}: " + " ".join(unknown))


def parse_config(argv: list[str] | None = None, prog: str | None = None, description: str | None = None
                 ) -> AsyncGRPOConfig:
    """Flags and ``--config`` YAML into an AsyncGRPOConfig; ConfigError with one line on bad input.

    Without a model, dataset or reward function, the demo task's defaults fill every field
    the user did not set (on the command line or in the YAML file). ``--help`` prints every
    flag (under ``prog`` and ``description``) and exits 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
    given = _flag_names(argv)
    from_yaml, config_path = {}, None
    if argv.count("--config") > 1:
        raise ConfigError("--config: give one YAML file (put every setting in it, or give the others as flags: a "
                          "flag wins over the file)")
    if "--config" in argv:
        try:
            config_path = argv[argv.index("--config") + 1]
            with open(config_path) as f:
                from_yaml = yaml.safe_load(f) or {}
                given |= set(from_yaml.keys())
        except (IndexError, OSError, yaml.YAMLError, AttributeError) as err:
            raise ConfigError(f"--config: cannot read a YAML mapping: {err}") from None
    if not given & {"model_name_or_path", "dataset_name", "datasets", "reward_funcs"}:
        if _flag_value(argv, "builtin_task", from_yaml.get("builtin_task")) == "lookup":
            from asyncgrpo.tasks.lookup import LOOKUP_DEFAULTS as task_defaults
        else:
            from asyncgrpo.tasks.demo import DEMO_DEFAULTS as task_defaults

        # Checkpoints, so that relaunching the demo on its run directory resumes.
        defaults = {**task_defaults, "save_strategy": "steps", "save_steps": 100, "save_total_limit": 2}
        argv = [f"--{k}={v}" for k, v in defaults.items() if k not in given] + argv
    parser = TrlParser((AsyncGRPOConfig,), prog=prog, description=description)
    parser.allow_abbrev = False  # argparse would take --learning_rat for --learning_rate, silently
    _refuse_unknown_flags(argv, from_yaml, config_path, parser)

    on_command_line = _flag_names(argv)

    def one_line_error(message: str):  # argparse would print its whole usage block and exit
        # A bad value read from the YAML file (TrlParser hands its keys to argparse as flags): the file is named.
        flag = re.match(r"argument --(\w+)", message)
        if config_path is not None and flag and flag[1] in from_yaml and flag[1] not in on_command_line:
            message = f"--config {config_path}: {flag[1]}: {message.split(': ', 1)[-1]}"
        raise ConfigError(message)

    parser.error = one_line_error
    try:
        with warnings.catch_warnings():
            if "gradient_checkpointing" not in given:  # TRL's own default trips transformers' rename warning
                warnings.filterwarnings("ignore", message="`gradient_checkpointing", category=FutureWarning)
            (cfg,) = parser.parse_args_and_config(argv)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(first_line(err, with_type=False)) from None
    return cfg
