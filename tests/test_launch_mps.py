"""launch.sh's NVIDIA MPS handling (scripts/launch_common.sh start_mps / stop_mps), with stand-ins for
nvidia-cuda-mps-control and for the Python that tries one CUDA call: where the daemon starts and where it
refuses, what the processes are told (ASYNCGRPO_MPS, the pipe folder inside the run), and that it is stopped
however the script ends. The CUDA IPC weight path under a real MPS daemon is a gpu test
(tests/asyncgrpo/weights/test_gpu_path.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import REPO

pytestmark = pytest.mark.process

# The part of launch.sh around MPS: start_mps after the device is known, stop_mps on EXIT, then an ending.
SCRIPT = """
say() { echo "[launch] $*"; }
source "$REPO/scripts/launch_common.sh"
trap stop_mps EXIT
start_mps "$SHARED" "$MODE" "$RUN"
echo "ASYNCGRPO_MPS=$ASYNCGRPO_MPS"
echo "PIPE=${CUDA_MPS_PIPE_DIRECTORY:-}"
[ "$ENDING" = killed ] && kill -TERM $$
exit 7
"""


def fake_tools(folder, *, daemon_ok: bool = True, probe_ok: bool = True):
    """A bin folder with a nvidia-cuda-mps-control that logs its arguments and input, and a python for the probe."""
    folder.mkdir()
    calls = folder / "calls.txt"
    (folder / "nvidia-cuda-mps-control").write_text(
        f'#!/bin/sh\nif [ "$1" = -d ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >> {calls}; '
        f'{"exit 0" if daemon_ok else "echo cannot open pipe >&2; exit 1"}\n'
        f'else echo "$(cat)" >> {calls}; fi\n')
    probe = "exit 0\n" if probe_ok else "echo 'CUDA error: MPS client failed' >&2\nexit 1\n"
    (folder / "python").write_text("#!/bin/sh\n" + probe)
    for tool in ("nvidia-cuda-mps-control", "python"):
        os.chmod(folder / tool, 0o755)
    return calls


def launch_part(tmp_path, *, mode="auto", shared="1", device="cuda", ending="exit", path_has_tools=True, **faults):
    bin_dir = tmp_path / "bin"
    calls = fake_tools(bin_dir, **faults)
    run = tmp_path / "run"
    env = {**os.environ, "REPO": str(REPO), "SHARED": shared, "MODE": mode, "RUN": str(run), "ENDING": ending,
           "DEVICE": device, "VENV_PY": str(bin_dir / "python"),
           "PATH": (f"{bin_dir}:" if path_has_tools else "") + "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    fields = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line and not line.startswith("["))
    return out, fields, (calls.read_text().splitlines() if calls.exists() else []), run


@pytest.mark.parametrize("ending", ["exit", "killed"])
def test_a_shared_gpu_gets_mps_in_the_run_folder_and_it_stops_however_the_run_ends(tmp_path, ending):
    out, fields, calls, run = launch_part(tmp_path, ending=ending)
    assert fields["ASYNCGRPO_MPS"] == "on"
    assert fields["PIPE"] == str(run / "mps" / "pipe")
    assert "[launch] NVIDIA MPS on" in out.stdout
    assert calls == [f"start {run / 'mps' / 'pipe'}", "quit"]  # started once, quit at the end


@pytest.mark.parametrize(("faults", "why"), [
    ({"daemon_ok": False}, "nvidia-cuda-mps-control -d failed: cannot open pipe"),
    ({"probe_ok": False}, "a CUDA call under MPS failed: CUDA error: MPS client failed"),
])
def test_mps_that_cannot_start_is_said_in_one_line_and_the_run_goes_on_without_it(tmp_path, faults, why):
    out, fields, calls, _ = launch_part(tmp_path, **faults)
    assert fields["ASYNCGRPO_MPS"] == f"off: {why}"
    assert fields["PIPE"] == ""  # the processes are not pointed at a daemon that does not work
    assert out.stdout.count("NVIDIA MPS off") == 1 and why in out.stdout
    assert out.returncode == 7  # the run went on to its own end
    if faults.get("probe_ok") is False:
        assert calls[-1] == "quit"  # the daemon that started is not left behind


def test_on_cpu_nothing_is_started_or_said(tmp_path):
    out, fields, calls, _ = launch_part(tmp_path, device="cpu", mode="on")
    assert fields["ASYNCGRPO_MPS"] == "" and calls == [] and "[launch]" not in out.stdout


@pytest.mark.parametrize(("settings", "why", "said"), [
    ({"mode": "off"}, "--mps off", True),
    ({"shared": ""}, "no GPU is shared by two processes", False),
    ({"path_has_tools": False}, "nvidia-cuda-mps-control is not on PATH", True),
    ({"path_has_tools": False, "mode": "on", "shared": ""}, "nvidia-cuda-mps-control is not on PATH", True),
])
def test_where_mps_is_not_started(tmp_path, settings, why, said):
    out, fields, calls, _ = launch_part(tmp_path, **settings)
    assert fields["ASYNCGRPO_MPS"] == f"off: {why}"
    assert calls == []
    assert ("NVIDIA MPS off" in out.stdout) is said


# launch.sh's placement (gpu_env), as `ps --check_only` said: cuda, 4 GPUs.
PLACEMENT = """
die() { echo "die: $*"; exit 2; }
source "$REPO/scripts/launch_common.sh"
checked_inputs "$(printf '/runs/x\ncuda 4\n')"
for i in 0 1 2 3 4; do echo "$i=$(gpu_env $i)"; done
"""


@pytest.mark.parametrize(("visible", "ps_procs", "expected"), [
    (None, 1, ["0", "1,0", "2,0", "3,0", "0"]),
    ("4,5,6,7", 1, ["4", "5,4", "6,4", "7,4", "4"]),  # a scheduler gave the job GPUs 4-7: only those are used
    ("GPU-a,GPU-b,GPU-c,GPU-d", 2, ["GPU-a,GPU-b", "GPU-c,GPU-a", "GPU-d,GPU-a", "GPU-c,GPU-a", "GPU-d,GPU-a"]),
])
def test_processes_are_placed_on_the_gpus_launch_sh_was_given(tmp_path, visible, ps_procs, expected):
    env = {"PATH": "/usr/bin:/bin", "REPO": str(REPO), "PS_PROCS": str(ps_procs),
           **({"CUDA_VISIBLE_DEVICES": visible} if visible else {})}
    out = subprocess.run(["bash", "-c", PLACEMENT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"{i}={gpus}" for i, gpus in enumerate(expected)]
