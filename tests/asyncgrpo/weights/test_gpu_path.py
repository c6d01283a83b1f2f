"""The GPU weight path as launch.sh sets it up: the PS and a worker are separate processes,
each with its own CUDA_VISIBLE_DEVICES (gpu_env in launch.sh), so the worker finds the PS's
GPU by UUID and opens its CUDA IPC handles under another device numbering. Checked: exact
weights (bf16 and fp32 in one model, a tied pair), no torn read while the PS publishes flat
out, and a PS that closes while the worker still maps its buffers. All marked ``gpu``.

ASYNCGRPO_GPU_TESTS_ON_CPU=1 runs the same process choreography on CPU with the mmap
transport (no device numbering, no IPC): a check of the tests themselves where there is no
GPU, not of the GPU path.

This file is also the script its subprocesses run:
    python tests/asyncgrpo/weights/test_gpu_path.py ps_exact RUN SYNC_DIR VERSIONS
    python tests/asyncgrpo/weights/test_gpu_path.py worker_exact RUN SYNC_DIR VERSIONS
    python tests/asyncgrpo/weights/test_gpu_path.py ps_race RUN SYNC_DIR SECONDS MAX_VERSIONS
    python tests/asyncgrpo/weights/test_gpu_path.py worker_race RUN SYNC_DIR
    python tests/asyncgrpo/weights/test_gpu_path.py ps_close RUN SYNC_DIR VALUE
    python tests/asyncgrpo/weights/test_gpu_path.py worker_close RUN SYNC_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers import fill, held_values, start_script, wait_for

from asyncgrpo.run import RunDir, fileops
from asyncgrpo.weights import make_publisher, make_subscriber, read_version_file

HERE = Path(__file__).resolve()
ON_CPU = os.environ.get("ASYNCGRPO_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
PROC_TIMEOUT_S = 180
STEP_TIMEOUT_S = 120  # one hand-over between the PS and the worker (includes a process's CUDA start-up)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU),
                                                  reason="needs a CUDA device")]


def gpu_count() -> int:
    return 0 if ON_CPU else torch.cuda.device_count()


def launch_sh_visible_devices(index: int) -> str:
    """launch.sh's gpu_env: the PS (0) sees GPU 0; worker i sees 'i mod G,0' (or '0')."""
    gpu = index % max(gpu_count(), 1)
    return "0" if gpu == 0 else f"{gpu},0"


def uuid_visible_devices() -> str:
    """The same GPUs as launch.sh's worker 1, named by UUID (as CUDA accepts them), in
    reverse order when there are two: the PS's GPU is then the worker's cuda:1."""
    if ON_CPU:
        return ""
    uuids = [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(min(gpu_count(), 2))]
    return ",".join(reversed(uuids))


def mixed_model(seed: int | None = None, device: str = "cpu") -> torch.nn.Module:
    """fp32 and bf16 parameters and a tied pair. With a seed: random values (built on CPU, so
    every process builds the same ones), else zeros."""
    if seed is not None:
        torch.manual_seed(seed)
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(96, 64)
    m.wide = torch.nn.Linear(64, 256)
    m.narrow = torch.nn.Linear(256, 64).to(torch.bfloat16)
    m.norm = torch.nn.LayerNorm(64).to(torch.bfloat16)
    m.head = torch.nn.Linear(64, 96, bias=False)
    m.head.weight = m.emb.weight
    if seed is None:
        with torch.no_grad():
            for t in m.state_dict().values():
                t.zero_()
    return m.to(device)


def wait_for_file(path: Path, timeout: float = STEP_TIMEOUT_S, procs=()) -> None:
    """A hand-over between the processes: another one touches ``path`` (failing early if one of ``procs`` exits)."""
    wait_for(path.exists, f"{path.name} to appear", timeout, procs=procs, poll_s=0.005)


def start(role: str, visible_devices: str, *args: str) -> subprocess.Popen:
    return start_script(HERE, role, *args, env={"CUDA_VISIBLE_DEVICES": None if ON_CPU else visible_devices})


def finish(*procs: subprocess.Popen) -> list[dict]:
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=PROC_TIMEOUT_S)
            assert proc.returncode == 0, (proc.args[2], proc.returncode, out)
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outs


PLACEMENTS = ["launch_sh", "uuid"]


def worker_devices(placement: str) -> str:
    return launch_sh_visible_devices(1) if placement == "launch_sh" else uuid_visible_devices()


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("placement", PLACEMENTS)
def test_worker_under_its_own_device_numbering_gets_exact_weights(run, tmp_path, placement):
    versions = "4"
    ps = start("ps_exact", launch_sh_visible_devices(0), str(run.root), str(tmp_path), versions)
    worker = start("worker_exact", worker_devices(placement), str(run.root), str(tmp_path), versions)
    published, synced = finish(ps, worker)
    assert synced["versions"] == list(range(1, int(versions) + 1))
    assert synced["mismatches"] == []  # every tensor equal to the PS's, in its own dtype
    assert synced["tied"] is True
    if not ON_CPU:
        assert published["transport"] == synced["transport"] == "cuda_ipc"
        assert synced["ps_gpu_uuid"] == published["gpu_uuid"]  # found by UUID, whatever its number there
        two = gpu_count() >= 2
        # launch.sh's worker 1 on two GPUs sees "1,0"; the UUID list is reversed: the PS's GPU is its cuda:1.
        assert synced["ps_gpu_index_here"] == (1 if two else 0)
        assert (synced["model_gpu_uuid"] == published["gpu_uuid"]) is not two  # two GPUs: copied peer to peer


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_no_torn_read_across_processes_with_mixed_dtypes(run, tmp_path, placement):
    # bf16 holds integers exactly up to 256: versions stay below that.
    ps = start("ps_race", launch_sh_visible_devices(0), str(run.root), str(tmp_path), "4", "250")
    worker = start("worker_race", worker_devices(placement), str(run.root), str(tmp_path))
    published, report = finish(ps, worker)
    assert published["versions"] >= 50, published
    assert report["bad"] == [], report["bad"][:5]  # (version reported, values held): never mixed or mislabelled
    assert report["versions"][-1] == published["versions"]
    assert len(report["versions"]) >= 10, report  # it raced: many syncs while the PS was publishing
    assert report["versions"] == sorted(set(report["versions"]))


def test_ps_closing_while_a_worker_maps_its_buffers(run, tmp_path):
    first = start("ps_close", launch_sh_visible_devices(0), str(run.root), str(tmp_path), "1")
    worker = start("worker_close", launch_sh_visible_devices(1), str(run.root), str(tmp_path))
    wait_for_file(tmp_path / "checked-closed", PROC_TIMEOUT_S, procs=(first, worker))
    second = start("ps_close", launch_sh_visible_devices(0), str(run.root), str(tmp_path), "2")
    closed, synced, reopened = finish(first, worker, second)
    assert closed["close_s"] < 30  # the worker's mapping does not hold the PS up
    if not ON_CPU:
        assert closed["freed_bytes"] >= 2 * closed["slot_bytes"]  # both slots freed at once, not in IPC limbo
    assert synced["after_close"] is None and synced["values_after_close"] == [1.0]  # kept its weights
    assert synced["reader_dropped"] is True  # and let go of the closed PS's buffers
    assert synced["from_new_ps"] == 1 and synced["values_from_new_ps"] == [2.0]
    assert reopened["close_s"] < 30


@pytest.fixture
def mps():
    """An NVIDIA MPS control daemon of the test's own, started as launch.sh starts one (scripts/launch_common.sh
    start_mps); yields the environment of its clients and its log folder, and quits it."""
    control = shutil.which("nvidia-cuda-mps-control")
    if ON_CPU or control is None:
        pytest.skip("needs NVIDIA MPS (nvidia-cuda-mps-control on PATH)")
    root = Path(tempfile.mkdtemp(prefix="mps-"))  # short: the control pipe is a Unix socket (108 characters)
    folders = {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
    for folder in folders.values():
        os.makedirs(folder)
    subprocess.run([control, "-d"], env={**os.environ, **folders}, check=True, timeout=60)
    try:
        yield folders, root / "log"
    finally:
        subprocess.run([control], input="quit\n", text=True, env={**os.environ, **folders}, timeout=60)


def test_cuda_ipc_weights_are_exact_between_mps_clients(run, tmp_path, mps):
    """The PS and a worker as launch.sh starts them with --mps on: CUDA IPC between two MPS clients."""
    env, logs = mps
    versions = "4"
    ps = start_script(HERE, "ps_exact", str(run.root), str(tmp_path), versions,
                      env={"CUDA_VISIBLE_DEVICES": launch_sh_visible_devices(0), **env})
    worker = start_script(HERE, "worker_exact", str(run.root), str(tmp_path), versions,
                          env={"CUDA_VISIBLE_DEVICES": launch_sh_visible_devices(1), **env})
    published, synced = finish(ps, worker)
    assert synced["versions"] == list(range(1, int(versions) + 1))
    assert synced["mismatches"] == []
    assert published["transport"] == synced["transport"] == "cuda_ipc"
    # The MPS server starts when its first client connects: both processes ran as its clients.
    assert (logs / "server.log").exists(), sorted(p.name for p in logs.iterdir())


# ---------------------------------------------------------------- subprocess roles

def _device_uuid(index: int) -> str | None:
    return None if ON_CPU else str(torch.cuda.get_device_properties(index).uuid)


def _ps_exact_main(root: str, sync_dir: str, versions: str) -> None:
    run, sync = RunDir.open(root), Path(sync_dir)
    model = mixed_model(0, DEVICE)
    publisher = make_publisher(run, model)
    for v in range(1, int(versions) + 1):
        with torch.no_grad():
            for name, t in mixed_model(v).state_dict().items():
                model.state_dict()[name].copy_(t)
        publisher.publish(v, v)
        (sync / f"published-{v}").touch()
        wait_for_file(sync / f"synced-{v}")
    publisher.close()
    print(json.dumps({"transport": publisher.transport, "gpu_uuid": _device_uuid(0)}))


def _worker_exact_main(root: str, sync_dir: str, versions: str) -> None:
    run, sync = RunDir.open(root), Path(sync_dir)
    model = mixed_model(None, DEVICE)  # its own cuda:0: another GPU than the PS's when there are two
    subscriber = make_subscriber(run)
    got, mismatches = [], []
    for v in range(1, int(versions) + 1):
        wait_for_file(sync / f"published-{v}")
        got.append(subscriber.sync(model))
        expected = mixed_model(v).state_dict()
        for name, t in model.state_dict().items():
            if t.dtype != expected[name].dtype or not torch.equal(t.cpu(), expected[name]):
                mismatches.append((v, name))
        (sync / f"synced-{v}").touch()
    reader = subscriber._reader
    report = {"versions": got, "mismatches": mismatches, "transport": read_version_file(run)["transport"],
              "tied": model.head.weight.data_ptr() == model.emb.weight.data_ptr()}
    if not ON_CPU:  # the GPU the reader opened the PS's buffers on, in this process's numbering
        report.update(ps_gpu_index_here=reader.device.index, ps_gpu_uuid=_device_uuid(reader.device.index),
                      model_gpu_uuid=_device_uuid(0))
    subscriber.close()
    print(json.dumps(report))


def _ps_race_main(root: str, sync_dir: str, seconds: str, max_versions: str) -> None:
    run, sync = RunDir.open(root), Path(sync_dir)
    model = mixed_model(None, DEVICE)
    publisher = make_publisher(run, model)
    wait_for_file(sync / "reader-ready")
    stop, v = time.monotonic() + float(seconds), 0
    while v < int(max_versions) and time.monotonic() < stop:
        v += 1
        fill(model, v)  # every tensor of version v holds exactly v
        publisher.publish(v, v)
    fileops.write_json(sync / "last.json", {"last": v})
    wait_for_file(sync / "reader-finished")  # the buffers stay until the reader has the last version
    publisher.close()
    print(json.dumps({"versions": v}))


def _worker_race_main(root: str, sync_dir: str) -> None:
    run, sync = RunDir.open(root), Path(sync_dir)
    model = mixed_model(None, DEVICE)
    subscriber = make_subscriber(run)
    (sync / "reader-ready").touch()
    versions, bad, deadline = [], [], time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        got = subscriber.sync(model)
        if got is not None:
            values = held_values(model)
            if values != [float(got)]:
                bad.append((got, values[:4]))
            versions.append(got)
        done = fileops.read_json(sync / "last.json")
        if done is not None and versions and versions[-1] == done["last"]:
            break
    (sync / "reader-finished").touch()
    subscriber.close()
    print(json.dumps({"versions": versions, "bad": bad}))


def _ps_close_main(root: str, sync_dir: str, value: str) -> None:
    run, sync = RunDir.open(root), Path(sync_dir)
    model = mixed_model(None, DEVICE)
    fill(model, int(value))
    publisher = make_publisher(run, model)
    publisher.publish(1, 1)
    (sync / f"published-by-{value}").touch()
    wait_for_file(sync / f"synced-from-{value}")  # the worker has opened (mapped) this PS's buffers
    before = torch.cuda.memory_allocated(0) if not ON_CPU else 0
    t0 = time.monotonic()
    publisher.close()
    close_s = time.monotonic() - t0
    freed = before - torch.cuda.memory_allocated(0) if not ON_CPU else 0
    (sync / f"closed-{value}").touch()
    if value == "1":
        wait_for_file(sync / "checked-closed")  # alive while the worker looks: "closed", not "PS gone"
    print(json.dumps({"close_s": close_s, "freed_bytes": freed, "slot_bytes": publisher.layout.total_bytes}))


def _worker_close_main(root: str, sync_dir: str) -> None:
    run, sync = RunDir.open(root), Path(sync_dir)
    model = mixed_model(None, DEVICE)
    subscriber = make_subscriber(run)
    wait_for_file(sync / "published-by-1")
    assert subscriber.sync(model) == 1 and held_values(model) == [1.0]
    (sync / "synced-from-1").touch()
    wait_for_file(sync / "closed-1")
    after_close = subscriber.sync(model)
    report = {"after_close": after_close, "values_after_close": held_values(model),
              "reader_dropped": subscriber._reader is None}
    (sync / "checked-closed").touch()
    wait_for_file(sync / "published-by-2", PROC_TIMEOUT_S)
    report["from_new_ps"] = subscriber.sync(model)
    report["values_from_new_ps"] = held_values(model)
    (sync / "synced-from-2").touch()
    wait_for_file(sync / "closed-2")
    subscriber.close()
    print(json.dumps(report))


if __name__ == "__main__":
    role, *argv = sys.argv[1:]
    {"ps_exact": _ps_exact_main, "worker_exact": _worker_exact_main, "ps_race": _ps_race_main,
     "worker_race": _worker_race_main, "ps_close": _ps_close_main, "worker_close": _worker_close_main}[role](*argv)
