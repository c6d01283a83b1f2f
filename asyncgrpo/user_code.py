"""The user's own code, named by import path on the command line: reward functions, and the hooks TRL's
GRPOTrainer takes for multi-turn rollouts (``--tools``, ``--environment_factory``, ``--rollout_func``).

A path is ``module:name`` (or ``module.name``), imported from the folder the process was started in, as
``python`` would (launch.sh starts every process there): a ``tools.py`` next to the user imports. Anything
that does not import or is not callable is a ConfigError of one line, raised by ``check_inputs``
(asyncgrpo/checks.py) before any process starts, so that the PS and every worker fail the same way, up front.

The PS and every worker load the same hooks: the workers run TRL's tool loop inside generation; the PS
builds its trainer with them too, so that its reward sources (an environment's ``get_reward``), metric
names and chat-template checks are the workers'.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncgrpo.config import AsyncGRPOConfig, ConfigError
from asyncgrpo.messages import first_line


@contextlib.contextmanager
def cwd_first_on_path():
    """A module next to the user imports, as with `python`; only while the user's modules are imported, so that no
    later import of this process picks a file of the user's folder that shadows a library module."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def import_callable(spec: str, flag: str, what: str = "function") -> Callable:
    """The callable ``spec`` names ('module:name' or 'module.name'), imported from the current folder."""
    module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{flag} {spec!r}: expected 'module:{what}' or 'module.{what}'")
    with cwd_first_on_path():
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # any import-time failure of user code is a bad input
            reason = first_line(err, with_type=False)
            if module_name.endswith(".py"):  # (a file's name for its module's: rewards.py:correct)
                reason += f": name the module, not its file: {module_name.removesuffix('.py')}:{attr}"
            raise ConfigError(f"{flag} {spec!r}: cannot import {module_name}: {reason}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        close = difflib.get_close_matches(attr, [n for n in dir(module) if not n.startswith("_")], n=3, cutoff=0.75)
        maybe = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(f"{flag} {spec!r}: {module_name} has no {what} {attr}{maybe}")
    if not callable(obj):
        raise ConfigError(f"{flag} {spec!r}: {module_name}.{attr} is not callable (a {type(obj).__name__})")
    return obj


@dataclass
class RolloutHooks:
    """What GRPOTrainer takes besides rewards to run a rollout: ``tools=``, ``environment_factory=``,
    ``rollout_func=`` (each None or empty when not given)."""

    tools: list[Callable] = field(default_factory=list)
    environment_factory: Callable | None = None
    rollout_func: Callable | None = None

    def trainer_kwargs(self) -> dict:
        return {"tools": self.tools or None, "environment_factory": self.environment_factory,
                "rollout_func": self.rollout_func}

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None


def load_rollout_hooks(cfg: AsyncGRPOConfig) -> RolloutHooks:
    """The hooks the config names (--tools, --environment_factory, --rollout_func), imported; or the built-in
    task's environment (asyncgrpo/tasks/lookup.py) for ``--builtin_task lookup``."""
    if cfg.builtin_task == "lookup" and not (cfg.tools or cfg.environment_factory or cfg.rollout_func):
        from asyncgrpo.tasks.lookup import LookupEnv

        return RolloutHooks(environment_factory=LookupEnv)
    return RolloutHooks(
        tools=[import_callable(spec, "--tools") for spec in cfg.tools or []],
        environment_factory=import_callable(cfg.environment_factory, "--environment_factory", "class")
        if cfg.environment_factory else None,
        rollout_func=import_callable(cfg.rollout_func, "--rollout_func") if cfg.rollout_func else None)
