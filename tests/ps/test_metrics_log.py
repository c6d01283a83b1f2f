"""What the PS logs for each step, read from a real run (the session's 8-step demo run, two workers)."""

import re

from asyncgrpo.run import fileops


def logged_dicts(ps_log: str) -> list[dict]:
    """The dicts TRL's log() prints for each step (every TrainerCallback and report_to integration gets these)."""
    return [dict(re.findall(r"'([\w/]+)': '?([^',}]+)'?", line)) for line in ps_log.splitlines()
            if line.lstrip().startswith("{'loss'")]


def test_num_tokens_is_the_ps_count_of_trained_tokens_and_only_grows(finished_demo_run):
    """Each worker counts only the jobs it generated; the PS's num_tokens counts every job it trained."""
    steps = logged_dicts((finished_demo_run.parent / "ps.log").read_text())
    assert len(steps) == 8
    counts = [float(step["num_tokens"]) for step in steps]
    assert all(later > earlier for earlier, later in zip(counts, counts[1:], strict=False)), counts
    done = finished_demo_run / "done"
    trained = [fileops.load_payload(path)["data"]["batch"] for path in done.glob("*_consumed.pt")]
    assert len(trained) == 8
    # TRL's count: prompt and completion tokens of every generation batch trained on.
    expected = sum(int(b["prompt_mask"].sum() + b["completion_mask"].sum()) for b in trained)
    assert abs(counts[-1] - expected) <= 1e-3 * expected  # the log prints 4 significant digits
