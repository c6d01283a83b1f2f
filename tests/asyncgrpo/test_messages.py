"""One-line messages: an error's first line, a line logged once per process, failures said once and then counted."""

import logging

from asyncgrpo.messages import RepeatedFailureLog, first_line, log_once


def test_first_line_names_the_type_and_keeps_one_line():
    assert first_line(ValueError("bad value\n  at line 3\n")) == "ValueError: bad value"
    assert first_line(ValueError("\n  bad value")) == "ValueError: bad value"
    assert first_line(OSError("disk full"), with_type=False) == "disk full"
    assert first_line(StopIteration()) == "StopIteration"  # an empty message: the type alone, either way
    assert first_line(StopIteration(), with_type=False) == "StopIteration"


def test_log_once_logs_each_key_once(caplog):
    log = logging.getLogger("asyncgrpo.test")
    with caplog.at_level(logging.INFO, logger="asyncgrpo.test"):
        for _ in range(3):
            log_once(log, "capture off: %s", "a hook is missing")
            log_once(log, "probe failed on %s", "/x", key="probe EIO", level=logging.WARNING)
            log_once(log, "probe failed on %s", "/y", key="probe EIO", level=logging.WARNING)  # same key
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "capture off: a hook is missing"), ("WARNING", "probe failed on /x")]


def test_a_repeated_failure_log_says_which_failure_was_the_first_of_its_kind():
    # (worker/results.py logs a failed job's traceback with the first of its kind only: tests/worker/test_results.py)
    errors = RepeatedFailureLog(logging.getLogger("asyncgrpo.test"), "jobs")
    assert [errors.failed(kind) for kind in ("a", "a", "b", "a")] == [True, False, True, False]


def test_the_deprecations_trl_trips_in_transformers_are_quiet_and_no_others():
    """TRL turns gradient checkpointing off and on around generation through names transformers 5 deprecated: a
    FutureWarning in every worker's log and at every evaluation in the PS's, which no user can act on."""
    import warnings

    from asyncgrpo.messages import quiet_library_deprecations

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_library_deprecations()
        for name in ("is_gradient_checkpointing", "gradient_checkpointing_enable", "gradient_checkpointing_disable",
                     "from_pretrained_keras"):
            warnings.warn(f"`{name}` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["`from_pretrained_keras` is deprecated and will be removed in v6."]
