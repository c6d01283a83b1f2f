"""One-line messages for the operator: the first line of an error, and a line logged once per process."""

from __future__ import annotations

import logging

_said: set[str] = set()


def first_line(err: BaseException, *, with_type: bool = True) -> str:
    """``"ValueError: <the first line of its message>"``; its type alone when the message is empty."""
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__
    return f"{type(err).__name__}: {lines[0]}" if with_type else lines[0]


def log_once(logger: logging.Logger, msg: str, *args, key: str | None = None, level: int = logging.INFO) -> None:
    """Logs ``msg % args`` the first time this process meets ``key`` (default: the line itself): for what is a
    property of the run's setup, which every job would otherwise repeat."""
    key = key if key is not None else msg % args if args else msg
    if key not in _said:
        _said.add(key)
        logger.log(level, msg, *args)
