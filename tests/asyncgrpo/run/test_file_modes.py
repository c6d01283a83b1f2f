"""What a run writes is its owner's alone by default: another local user can open none of it (a lock file
they could open is a lock they could take, and block the PS with). --share_with_group: tests/asyncgrpo/
test_trl_flags.py, a launch.sh run; the weight buffers and launch.sh's logs: tests/e2e/test_e2e.py."""

import os

import pytest
from helpers import modes_beyond, open_as_nobody

from asyncgrpo.run import RunDir


@pytest.mark.process
def test_a_finished_run_is_its_owners_alone(finished_demo_run):
    assert modes_beyond(finished_demo_run, 0o700) == []
    assert not open_as_nobody(finished_demo_run, "ps.lock")


def test_a_run_directory_made_by_someone_else_takes_the_runs_modes(tmp_path):
    # launch.sh, or the user, may have made the folder with their umask (0755) before the PS starts.
    root = tmp_path / "run"
    (root / "logs").mkdir(parents=True, mode=0o755)
    (root / "logs").chmod(0o755)
    umask = os.umask(0o022)
    try:
        run = RunDir.create(root)
        assert os.umask(0o022) == 0o077  # and the files this process creates from here on
        assert modes_beyond(root, 0o700) == [] and not run.shared_with_group
        run = RunDir.create(root, share_with_group=True)
        assert os.umask(0o022) == 0o007
        assert {oct(d.stat().st_mode & 0o7777) for d in [root, *root.iterdir()]} == {"0o2770"}
        assert run.shared_with_group
    finally:
        os.umask(umask)
