"""Weight transports (asyncgrpo.weights): round trips, no torn reads between real processes,
PS restarts and crashes, no PS at all. GPU (cuda_ipc) tests run only where CUDA is.

This file is also the script its subprocesses run:
    python tests/asyncgrpo/weights/test_weights.py publish RUN TRANSPORT DEVICE SECONDS MAX_VERSIONS SYNC_DIR READERS
    python tests/asyncgrpo/weights/test_weights.py read RUN DEVICE SYNC_DIR SEED
    python tests/asyncgrpo/weights/test_weights.py crash RUN [TRANSPORT]
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch
from helpers import fill, held_values, start_script, wait_for

from asyncgrpo.run import RunDir, fileops
from asyncgrpo.weights import make_publisher, make_subscriber, mmap_file, read_version_file
from asyncgrpo.weights.base import layout_path, version_path
from asyncgrpo.weights.layout import Layout

HERE = Path(__file__).resolve()
PROC_TIMEOUT_S = 120
CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def tiny_mlp(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def fill_model(device: str = "cpu") -> torch.nn.Module:
    """About 0.6 MB in three dtypes (fp32, fp16, int64), with a tied pair."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.big = torch.nn.Linear(256, 512)
    m.half = torch.nn.Linear(128, 128).half()
    m.emb = torch.nn.Embedding(64, 32)
    m.head = torch.nn.Linear(32, 64, bias=False)
    m.head.weight = m.emb.weight
    m.register_buffer("count", torch.zeros(8, dtype=torch.int64))
    return m.to(device)


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


def run_script(*args: str) -> subprocess.Popen:
    # One intra-op thread each (PROCESS_ENV): three processes share two cores here, and idle OpenMP
    # threads waking up cost milliseconds per op on a small VM.
    return start_script(HERE, *args)


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("transport", ["mmap", "safetensors"])
@pytest.mark.parametrize("factory", [tiny_llama, tiny_mlp], ids=["llama_tied", "sequential"])
def test_round_trip(run, transport, factory):
    ps, worker = factory(0), factory(1)
    assert not same_state(ps, worker)
    publisher, subscriber = make_publisher(run, ps, transport), make_subscriber(run)
    addresses = {name: t.data_ptr() for name, t in worker.state_dict().items()}
    try:
        publisher.publish(version=3, step=3)
        assert subscriber.latest_version() == 3
        assert subscriber.sync(worker) == 3
        assert same_state(ps, worker)
        assert subscriber.sync(worker) is None  # nothing new

        with torch.no_grad():
            for p in ps.parameters():
                p.add_(1.0)
        assert not same_state(ps, worker)
        publisher.publish(version=4, step=4)
        assert subscriber.sync(worker) == 4
        assert same_state(ps, worker)
        assert subscriber.sync(worker) is None
        # Every sync copied into the worker's own storage: compiled decoding's graphs hold these addresses.
        assert {name: t.data_ptr() for name, t in worker.state_dict().items()} == addresses
        if factory is tiny_llama:  # the tie survives: one tensor, both names
            assert worker.lm_head.weight.data_ptr() == worker.model.embed_tokens.weight.data_ptr()
    finally:
        publisher.close()
        subscriber.close()


def test_auto_is_mmap_on_cpu_and_the_version_file_is_plain_json(run):
    ps = tiny_llama(0)
    publisher = make_publisher(run, ps)
    try:
        assert publisher.transport == "mmap"
        publisher.publish(version=1, step=7)
        info = json.loads(version_path(run).read_bytes())
        assert info["version"] == 1 and info["step"] == 7 and info["buffer"] == 0
        assert info["transport"] == "mmap" and info["pid"] == os.getpid() and len(info["paths"]) == 2
        assert info["publisher_id"] == publisher.publisher_id and not info["closed"]
        layout = json.loads(layout_path(run, publisher.publisher_id).read_bytes())
        names = [t["name"] for t in layout["tensors"]]
        assert "lm_head.weight" not in names and layout["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
        assert set(names) | {"lm_head.weight"} == set(ps.state_dict())
        publisher.publish(version=2, step=8)
        assert read_version_file(run)["buffer"] == 1  # the other slot
    finally:
        publisher.close()
    assert read_version_file(run)["closed"]
    assert make_subscriber(run).latest_version() is None


def test_layout_groups_dtypes_into_one_region_each(run):
    publisher = make_publisher(run, fill_model())
    try:
        layout = json.loads(layout_path(run, publisher.publisher_id).read_bytes())
        groups = [g["dtype"] for g in layout["groups"]]  # in order of first use in the state_dict
        assert sorted(groups) == ["float16", "float32", "int64"]
        dtypes = [t["dtype"] for t in layout["tensors"]]
        assert dtypes == sorted(dtypes, key=groups.index)  # each dtype in one contiguous region
        assert all(t["offset"] % 256 == 0 for t in layout["tensors"])
    finally:
        publisher.close()


def test_worker_model_in_another_dtype_gets_converted_values(run):
    ps, worker = tiny_mlp(0), tiny_mlp(1).to(torch.float64)
    with closing(make_publisher(run, ps, "mmap")) as publisher:
        publisher.publish(1, 1)
        assert make_subscriber(run).sync(worker) == 1
        pairs = zip(ps.state_dict().values(), worker.state_dict().values(), strict=True)
        assert all(torch.equal(a.double(), b) for a, b in pairs)


def test_a_different_model_is_refused_loudly(run):
    with closing(make_publisher(run, tiny_mlp(0), "mmap")) as publisher:
        publisher.publish(1, 1)
        with closing(make_subscriber(run)) as subscriber, pytest.raises(ValueError, match="does not match"):
            subscriber.sync(tiny_llama(0))


def test_versions_must_increase(run):
    with closing(make_publisher(run, tiny_mlp(0), "mmap")) as publisher:
        publisher.publish(5, 5)
        with pytest.raises(ValueError, match="increase"):
            publisher.publish(5, 6)


def test_copy_tensors_memmove_and_fallback_paths():
    from asyncgrpo.weights.memcopy import copy_tensors

    torch.manual_seed(0)
    srcs = [torch.randn(3000, 2000), torch.randn(7).to(torch.bfloat16), torch.randn(5, 4), torch.randn(6)]
    dsts = [torch.empty(3000, 2000), torch.empty(7, dtype=torch.bfloat16), torch.empty(4, 5).t(),
            torch.empty(6, dtype=torch.float64)]  # plain (chunked), plain, strided, converting
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for d in dsts:
                d.zero_()
            copy_tensors(dsts, srcs)
        finally:
            torch.set_num_threads(prev)
        assert all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dsts, srcs, strict=True))


def test_take_and_put_of_scattered_elements_on_one_or_several_threads(monkeypatch):
    from asyncgrpo.weights import memcopy

    torch.manual_seed(0)
    flat = torch.randn(2_000_003).to(torch.bfloat16).view(torch.int16)
    for count in (5, 3 * memcopy._MIN_TAKE + 7):  # one thread's worth; parts on several threads, one longer
        positions = torch.randperm(flat.numel())[:count].sort().values
        values = torch.randint(-1000, 1000, (count,), dtype=torch.int16)
        expected = flat.clone()
        expected[positions] = values
        for threads in (1, 3):
            prev = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                taken = memcopy.take(flat, positions)
                written = flat.clone()
                memcopy.put(written, positions, values)
            finally:
                torch.set_num_threads(prev)
            assert torch.equal(taken, flat[positions])
            assert torch.equal(written, expected)
        monkeypatch.setattr(memcopy, "_PUT_CHUNK", 1000)  # written in chunks, the last one shorter
        written = flat.clone()
        memcopy.put(written, positions, values)
        assert torch.equal(written, expected)
        monkeypatch.undo()
    # A worker's trainable parameters (an adapter's), read under torch.no_grad, which the pool's threads do not share.
    weights = torch.nn.Parameter(torch.randn(flat.numel()))
    positions = torch.randperm(flat.numel())[:3 * memcopy._MIN_TAKE].sort().values
    prev = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with torch.no_grad():
            assert torch.equal(memcopy.take(weights, positions), weights[positions])
    finally:
        torch.set_num_threads(prev)


def test_spread_returns_each_items_result_in_order_and_raises_what_a_thread_raised():
    from asyncgrpo.weights import memcopy

    prev = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            ran_on = set()

            def square(i, ran_on=ran_on):
                ran_on.add(threading.get_ident())
                return i * i

            assert memcopy.spread(square, [(i,) for i in range(10)]) == [i * i for i in range(10)]
            assert len(ran_on) == 1 if threads == 1 else len(ran_on) >= 2  # (the caller's share, and the pool's)
            ran_on.clear()
            assert memcopy.spread(square, [(i,) for i in range(10)], most=1) == [i * i for i in range(10)]
            assert ran_on == {threading.get_ident()}
            assert memcopy.spread(square, []) == []

            def refuse(i):
                if i == 8:  # (item 8 of 9 is the third thread's share with three)
                    raise IndexError("item 8")
                return i

            with pytest.raises(IndexError, match="item 8"):
                memcopy.spread(refuse, [(i,) for i in range(9)])
    finally:
        torch.set_num_threads(prev)


def test_spread_within_a_share_runs_inline_and_an_error_waits_for_every_share():
    """A share that spreads again (a delta's tensors spread, each one's gather spread) must not wait for the pool it
    runs on; a share that raises must not leave another still writing after its caller went on."""
    from asyncgrpo.weights import memcopy

    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def inner(i):
            return (i, threading.get_ident())

        def outer(i):
            return memcopy.spread(inner, [(i * 10 + j,) for j in range(4)])

        got = []
        caller = threading.Thread(target=lambda: got.append(memcopy.spread(outer, [(i,) for i in range(4)])),
                                  daemon=True)
        caller.start()
        caller.join(60)  # (a share waiting for the pool it runs on waits forever)
        assert got, "a spread within a share waits for itself"
        [results] = got
        assert [[value for value, _ in r] for r in results] == [[i * 10 + j for j in range(4)] for i in range(4)]
        assert all(len({thread for _, thread in r}) == 1 for r in results)  # each share's items, on its own thread
        ended = threading.Event()

        def slow_or_refuse(i):
            if i == 0:  # (the caller's share)
                raise IndexError("item 0")
            time.sleep(0.5)  # (the other share, still running when the first raised)
            ended.set()

        with pytest.raises(IndexError, match="item 0"):
            memcopy.spread(slow_or_refuse, [(0,), (1,)])
        assert ended.is_set()
    finally:
        torch.set_num_threads(prev)


# ---------------------------------------------------------------- no PS, restarts, crashes

def test_no_ps_yet(run):
    subscriber = make_subscriber(run)
    worker = tiny_mlp(1)
    before = {k: v.clone() for k, v in worker.state_dict().items()}
    assert subscriber.latest_version() is None and subscriber.sync(worker) is None
    version_path(run).write_text("{not json")
    assert subscriber.latest_version() is None and subscriber.sync(worker) is None
    fileops.write_json(version_path(run), {"version": 1, "transport": "mmap", "publisher_id": "0" * 32,
                                           "buffer": 0, "paths": ["/etc/passwd", "/etc/passwd"]})
    assert subscriber.sync(worker) is None  # no layout file: nothing, no crash
    fileops.write_json(layout_path(run, "1" * 32), Layout.of(tiny_mlp(0).state_dict()).to_json())
    fileops.write_json(version_path(run), {"version": 1, "transport": "mmap", "publisher_id": "1" * 32,
                                           "buffer": 0, "paths": ["/etc/passwd", "/etc/passwd"]})
    assert subscriber.sync(worker) is None  # paths this publisher could not have made: never mapped
    assert all(torch.equal(before[k], v) for k, v in worker.state_dict().items())
    subscriber.close()


@pytest.mark.process
def test_cuda_ipc_handles_of_a_dead_ps_are_not_opened(run):
    """Runs without a GPU too: the worker must not touch the handles of a PS that is gone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    layout = Layout.of(tiny_mlp(0).state_dict())
    publisher_id = "ab" * 16
    fileops.write_json(layout_path(run, publisher_id), layout.to_json())
    handle = {"handle": "00" * 64, "storage_size_bytes": layout.total_bytes, "storage_offset_bytes": 0,
              "ref_counter_handle": "00", "ref_counter_offset": 0, "event_handle": "00" * 64,
              "event_sync_required": False, "numel": layout.total_bytes, "device_index": 0}
    fileops.write_json(version_path(run), {
        "version": 2, "step": 2, "transport": "cuda_ipc", "publisher_id": publisher_id, "pid": dead.pid,
        "host": socket.gethostname(), "buffer": 0, "closed": False, "device_uuid": "GPU-none",
        "ipc": [handle, handle]})
    worker, subscriber = tiny_mlp(1), make_subscriber(run)
    before = {k: v.clone() for k, v in worker.state_dict().items()}
    assert subscriber.latest_version() == 2
    assert subscriber.sync(worker) is None and subscriber.sync(worker) is None
    assert all(torch.equal(before[k], v) for k, v in worker.state_dict().items())
    with pytest.raises(ValueError, match="GPU"):
        make_publisher(run, tiny_mlp(0), "cuda_ipc")  # a CPU model cannot publish through CUDA IPC
    subscriber.close()


@pytest.mark.parametrize("transport", ["mmap", "safetensors"])
@pytest.mark.parametrize("old_closes", [True, False], ids=["closed", "abandoned"])
def test_ps_restart_is_picked_up(run, transport, old_closes):
    worker, subscriber = fill_model(), make_subscriber(run)
    old_model = fill_model()
    fill(old_model, 1)
    old = make_publisher(run, old_model, transport)
    old.publish(10, 10)
    assert subscriber.sync(worker) == 10 and held_values(worker) == [1.0]
    if old_closes:
        old.close()
        assert subscriber.sync(worker) is None
    new_model = fill_model()
    fill(new_model, 2)
    new = make_publisher(run, new_model, transport)  # a restart from an older checkpoint: a lower version
    try:
        assert subscriber.sync(worker) is None  # the new PS has published nothing yet
        new.publish(4, 4)
        assert subscriber.sync(worker) == 4 and held_values(worker) == [2.0]
        assert subscriber.sync(worker) is None
        new.publish(5, 5)
        assert subscriber.sync(worker) == 5
    finally:
        new.close()
        if not old_closes:
            old.close()  # only now (same process): its version file was replaced, it leaves it alone
        subscriber.close()
    assert read_version_file(run)["publisher_id"] == new.publisher_id


@pytest.mark.process
def test_crashed_ps_leaves_weights_usable_and_its_folder_is_reaped(run):
    proc = run_script("crash", str(run.root))
    out, _ = proc.communicate(timeout=PROC_TIMEOUT_S)
    assert proc.returncode == 0, out
    dead_dir = Path(json.loads(out)["dir"])
    assert dead_dir.is_dir()  # no close(): the folder is still there
    worker, subscriber = fill_model(), make_subscriber(run)
    assert subscriber.sync(worker) == 3 and held_values(worker) == [7.0]  # the last complete version
    new_model = fill_model()
    fill(new_model, 8)
    with closing(make_publisher(run, new_model)) as new:
        assert not dead_dir.exists()  # the dead PS's /dev/shm folder is gone
        new.publish(1, 1)
        assert subscriber.sync(worker) == 1 and held_values(worker) == [8.0]
    subscriber.close()


def test_buffers_fall_back_to_the_run_dir_without_dev_shm(run, monkeypatch, tmp_path):
    monkeypatch.setattr(mmap_file, "SHM_ROOT", tmp_path / "no-dev-shm")
    ps, worker = tiny_llama(0), tiny_llama(1)
    with closing(make_publisher(run, ps)) as publisher:
        assert publisher.dir.parent == run.weights
        publisher.publish(1, 1)
        assert make_subscriber(run).sync(worker) == 1 and same_state(ps, worker)
    assert not publisher.dir.exists()


# ---------------------------------------------------------------- torn reads between processes

def _race(run, sync_dir: Path, transport: str, ps_device: str, reader_device: str, readers: int = 2,
          seconds: float = 3.0, max_versions: int = 400) -> tuple[dict, list[dict]]:
    sync_dir.mkdir()
    procs = [run_script("read", str(run.root), reader_device, str(sync_dir), str(seed)) for seed in range(readers)]
    ps = run_script("publish", str(run.root), transport, ps_device, str(seconds), str(max_versions),
                    str(sync_dir), str(readers))
    ps_out, _ = ps.communicate(timeout=PROC_TIMEOUT_S)
    outs = [p.communicate(timeout=PROC_TIMEOUT_S)[0] for p in procs]
    assert ps.returncode == 0 and all(p.returncode == 0 for p in procs), (ps_out, outs)
    return json.loads(ps_out), [json.loads(o) for o in outs]


def _check_race(published: dict, reports: list[dict]) -> None:
    assert published["versions"] >= 50, published
    for r in reports:
        assert r["bad"] == [], r["bad"][:5]  # (version reported, values held): never mixed or mislabelled
        assert r["last"] == published["last"], (r, published)
        assert len(r["versions"]) >= 10, r  # it really raced: many syncs while the PS was publishing
        assert r["versions"] == sorted(set(r["versions"]))


@pytest.mark.process
@pytest.mark.parametrize("transport", ["mmap", "safetensors"])
def test_no_torn_reads_while_the_ps_publishes_flat_out(run, tmp_path, transport):
    published, reports = _race(run, tmp_path / "sync", transport, "cpu", "cpu")
    _check_race(published, reports)


# ---------------------------------------------------------------- GPU (cuda_ipc)

@gpu
@needs_cuda
def test_cuda_ipc_round_trip_in_process(run):
    ps, worker = tiny_llama(0).cuda(), tiny_llama(1).cuda()
    with closing(make_publisher(run, ps)) as publisher:
        assert publisher.transport == "cuda_ipc"
        publisher.publish(1, 1)
        subscriber = make_subscriber(run)
        assert subscriber.sync(worker) == 1 and same_state(ps, worker)
        assert subscriber.sync(worker) is None
        subscriber.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("reader_device", ["cuda:0", "cuda:1"])
def test_cuda_ipc_no_torn_reads_across_processes(run, tmp_path, reader_device):
    """PS on GPU 0; the reader on the same GPU, or copying peer-to-peer into GPU 1."""
    if torch.cuda.device_count() <= int(reader_device[-1]):
        pytest.skip("needs a second GPU")
    published, reports = _race(run, tmp_path / "sync", "cuda_ipc", "cuda:0", reader_device, readers=1)
    _check_race(published, reports)


@gpu
@needs_cuda
def test_cuda_ipc_dead_ps_keeps_worker_weights(run):
    proc = run_script("crash", str(run.root), "cuda_ipc")
    out, _ = proc.communicate(timeout=PROC_TIMEOUT_S)
    assert proc.returncode == 0, out
    worker, subscriber = fill_model("cuda"), make_subscriber(run)
    fill(worker, 5)
    assert subscriber.sync(worker) is None and held_values(worker) == [5.0]  # the PS is dead: no crash
    new_model = fill_model("cuda")
    fill(new_model, 9)
    with closing(make_publisher(run, new_model)) as new:
        new.publish(1, 1)
        assert subscriber.sync(worker) == 1 and held_values(worker) == [9.0]
    subscriber.close()


# ---------------------------------------------------------------- subprocess roles

def _publish_main(root, transport, device, seconds, max_versions, sync_dir, readers) -> None:
    run, sync_dir = RunDir.open(root), Path(sync_dir)
    model = fill_model(device)
    publisher = make_publisher(run, model, transport)
    wait_for(lambda: len(list(sync_dir.glob("ready-*"))) >= int(readers), "every reader to be ready", 60, poll_s=0.01)
    stop, v = time.monotonic() + float(seconds), 0
    while v < int(max_versions) and time.monotonic() < stop:
        v += 1
        fill(model, v)  # every tensor of version v holds exactly v (fp16 is exact up to 2048)
        publisher.publish(version=v, step=v)
    fileops.write_json(sync_dir / "last.json", {"last": v})
    # The buffers stay alive until every reader has the last version.
    wait_for(lambda: len(list(sync_dir.glob("finished-*"))) >= int(readers), "every reader to finish", 60,
             poll_s=0.01)
    publisher.close()
    print(json.dumps({"versions": v, "last": v}))


def _read_main(root, device, sync_dir, seed) -> None:
    run, sync_dir = RunDir.open(root), Path(sync_dir)
    rng = random.Random(int(seed))
    model = fill_model(device)
    subscriber = make_subscriber(run)
    (sync_dir / f"ready-{seed}").touch()
    versions, bad, last, deadline = [], [], None, time.monotonic() + 90
    while time.monotonic() < deadline:
        got = subscriber.sync(model)
        if got is not None:
            values = held_values(model)
            if values != [float(got)]:
                bad.append((got, sorted(values)[:4]))
            versions.append(got)
        done = fileops.read_json(sync_dir / "last.json")
        if done is not None and versions and versions[-1] == done["last"]:
            last = done["last"]
            break
        if rng.random() < 0.5:
            time.sleep(rng.random() * 2e-4)  # vary the phase against the PS
    (sync_dir / f"finished-{seed}").touch()
    subscriber.close()
    print(json.dumps({"versions": versions, "bad": bad, "last": last}))


def _crash_main(root, transport="mmap") -> None:
    run = RunDir.open(root)
    model = fill_model("cuda" if transport == "cuda_ipc" else "cpu")
    fill(model, 7)
    publisher = make_publisher(run, model, transport)
    publisher.publish(3, 3)
    print(json.dumps({"dir": str(getattr(publisher, "dir", ""))}), flush=True)
    os._exit(0)  # no close(): as if killed


if __name__ == "__main__":
    role, *argv = sys.argv[1:]
    {"publish": _publish_main, "read": _read_main, "crash": _crash_main}[role](*argv)
