"""Shared fixtures: a fresh run directory and a queue over it, in pytest's tmp_path."""

import logging

import pytest

from asyncgrpo.jobqueue import JobQueue, RunDir


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir.create(tmp_path / "run")


@pytest.fixture
def queue(run) -> JobQueue:
    return JobQueue(run)


@pytest.fixture(autouse=True)
def _queue_logs_visible(caplog):
    caplog.set_level(logging.INFO, logger="asyncgrpo")
