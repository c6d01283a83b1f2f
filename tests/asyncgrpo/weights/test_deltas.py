"""Weights to other hosts as deltas (asyncgrpo/weights/deltas.py, snapshot.py): a version costs what changed,
a reader applies it in place and checks it before it writes, and falls back on an anchor.

This file is also the script its subprocesses run:
    python tests/asyncgrpo/weights/test_deltas.py publish RUN VERSIONS SYNC_DIR [KILL_AT]
    python tests/asyncgrpo/weights/test_deltas.py read RUN DEVICE SYNC_DIR
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch
from helpers import start_script, wait_for
from safetensors.torch import load_file, save

from asyncgrpo.run import RunDir, WorkerPresence, fileops
from asyncgrpo.weights import WeightsMismatch, deltas, make_subscriber, snapshot
from asyncgrpo.weights.snapshot import ANCHOR_EVERY, SnapshotPublisher, snapshot_dir, snapshot_path

HERE = Path(__file__).resolve()
PROC_TIMEOUT_S = 120


def small_model(seed: int, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(512, 64)
    m.proj = torch.nn.Linear(64, 128)
    m.norm = torch.nn.LayerNorm(128)
    return m.to(dtype)


def train_step(model: torch.nn.Module, step: int, lr: float = 1e-5) -> None:
    """A small update to every element, as an optimizer step makes: most keep their bf16 bits."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * lr)


def published(model: torch.nn.Module, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype) for k, v in model.state_dict().items()}


def bits_equal(a: torch.nn.Module, b: dict[str, torch.Tensor]) -> bool:
    sa = a.state_dict()
    return sa.keys() == b.keys() and all(torch.equal(deltas.flat_bits(sa[k]), deltas.flat_bits(b[k])) for k in sa)


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return (deltas.flat_bits(old) != deltas.flat_bits(new)).nonzero().reshape(-1)


def files(run) -> list[str]:
    return sorted(n for n in os.listdir(snapshot_dir(run)) if not n.startswith("."))


# ---------------------------------------------------------------- the checksum

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8])
def test_a_checksum_updated_from_the_changed_elements_is_the_whole_tensors(dtype):
    torch.manual_seed(0)
    old = (torch.randn(3, 1000) * 50).to(dtype)
    new = old.clone()
    flat = new.view(-1)
    positions = torch.randperm(flat.numel())[:40]
    flat[positions] = flat[positions] + 1
    changed = changed_positions(old, new)
    assert sorted(changed.tolist()) == sorted(positions.tolist())
    updated = deltas.updated(deltas.checksum(old), *deltas.position_sums(changed, deltas.flat_bits(old)[changed],
                                                                         deltas.flat_bits(new)[changed]))
    assert updated == deltas.checksum(new) != deltas.checksum(old)
    swapped = new.clone()
    swapped.view(-1)[[0, 1]] = new.view(-1)[[1, 0]]
    assert new.view(-1)[0] != new.view(-1)[1] and deltas.checksum(swapped) != deltas.checksum(new)


def test_the_checksum_of_a_tensor_longer_than_one_pass_covers_every_element(monkeypatch):
    monkeypatch.setattr(deltas, "_CHUNK", 64)
    torch.manual_seed(1)
    t = torch.randn(1000).to(torch.bfloat16)
    whole = deltas.checksum(t)
    for i in (0, 63, 64, 999):
        u = t.clone()
        u[i] += 1
        assert deltas.checksum(u) != whole
        assert deltas.updated(whole, *deltas.position_sums(torch.tensor([i]), deltas.flat_bits(t)[[i]],
                                                            deltas.flat_bits(u)[[i]])) == deltas.checksum(u)


@pytest.mark.parametrize("changes, step, kinds", [
    (40_000, 1, {"gap", "dif", "was"}),  # dense, a rounding step each: one byte a position, one a difference
    (4_000, 1, {"gap", "dif", "was"}),  # some gaps past 255: no-op positions between
    (3, 1, {"idx", "dif", "was"}),  # so sparse that int32 positions are smaller than the no-op ones
    (40_000, 300, {"gap", "val", "was"}),  # differences past a byte: the new bits whole
])
def test_a_delta_round_trips_in_each_of_its_forms(changes, step, kinds, monkeypatch):
    torch.manual_seed(0)
    old = torch.randn(1_000_000).to(torch.bfloat16)
    positions = torch.randperm(old.numel())[:changes].sort().values
    old_bits = deltas.flat_bits(old)
    new_bits = old_bits.clone()
    new_bits[positions] += step
    parts, written, values, checksum = deltas.encode(old_bits, new_bits, positions, deltas.checksum(old))
    assert checksum == deltas.checksum(new_bits)
    assert set(parts) == kinds
    assert deltas.nbytes(parts) < old.numel() * old.element_size()
    # Decoded in one pass, and in passes of 7 positions (the last one shorter) over three threads.
    for chunk, threads in ((deltas._DECODE_CHUNK, 1), (7, 3)):
        monkeypatch.setattr(deltas, "_DECODE_CHUNK", chunk)
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            decoded, bits, before, after = deltas.decode(parts, old, old.dtype)
        finally:
            torch.set_num_threads(prev)
        assert decoded.tolist() == written.tolist() and set(positions.tolist()) <= set(decoded.tolist())
        assert torch.equal(bits, new_bits[decoded]) and torch.equal(values, new_bits[decoded])
        applied = old_bits.clone()
        applied[decoded] = bits
        assert torch.equal(applied, new_bits)
        # What a reader checks the bits it holds against, and the checksum after.
        assert before == int(parts["was"]) and deltas.updated(deltas.checksum(old), before, after) == checksum


def test_a_delta_without_positions_or_with_positions_outside_its_tensor_is_refused_before_a_read():
    """KeyError, IndexError and ValueError are what the reader turns into a refused file (BadDelta). Out of range, the
    positions are refused before the gather: on a GPU an index out of range would end the worker's process."""
    held = torch.zeros(100, dtype=torch.bfloat16)
    two = {"dif": torch.zeros(2, dtype=torch.int8), "was": torch.tensor([0])}
    with pytest.raises(KeyError):  # (a garbled header lost the positions)
        deltas.decode(two, held, held.dtype)
    at = {"idx": torch.tensor([5, 7], dtype=torch.int32)}
    # Parts no writer makes: fewer values than positions (one would be added to every position), differences of
    # 8-byte elements or wider than a byte, values wider than the elements.
    for parts, dtype in (({**at, "dif": torch.zeros(1, dtype=torch.int8)}, torch.bfloat16),
                         ({**at, "val": torch.zeros(3, dtype=torch.int16)}, torch.bfloat16),
                         ({**at, "dif": torch.zeros(2, dtype=torch.int8)}, torch.float64),
                         ({**at, "dif": torch.zeros(2, dtype=torch.int16)}, torch.bfloat16),
                         ({**at, "val": torch.zeros(2, dtype=torch.int32)}, torch.bfloat16)):
        with pytest.raises(ValueError):
            deltas.decode({**parts, "was": torch.tensor([0])}, held.to(dtype), dtype)
    for positions in ({"idx": torch.tensor([5, 100], dtype=torch.int32)}, {"idx": torch.tensor([-1, 5])},
                      {"gap": torch.tensor([0, 3], dtype=torch.uint8)}):
        with pytest.raises(IndexError, match="outside the tensor"):
            deltas.decode({**positions, **two}, held, held.dtype)


# ---------------------------------------------------------------- publisher and reader

def test_versions_after_the_first_are_deltas_a_reader_applies_to_bit_identical_weights(run):
    """An fp32 PS publishing bf16 (the workers' dtype): the first version and every ANCHOR_EVERY-th are anchors,
    the others deltas a small part of an anchor's size; a bf16 worker that syncs every few versions holds the
    published bits exactly."""
    ps, worker = small_model(0), small_model(1, torch.bfloat16)
    subscriber = make_subscriber(run)
    sizes = {}
    with closing(SnapshotPublisher(run, ps, dtype=torch.bfloat16)) as publisher:
        for version in range(1, 2 * ANCHOR_EVERY + 3):
            train_step(ps, version)
            publisher.publish(version, version)
            sizes[version] = publisher.published_bytes
            if version % 3 == 0 or version == 2 * ANCHOR_EVERY + 2:
                assert subscriber.sync(worker) == version
                assert bits_equal(worker, published(ps))
            if version == 3:  # it read the anchor and two deltas
                assert subscriber.synced_bytes == sizes[1] + sizes[2] + sizes[3]
            if version == 6:
                assert subscriber.synced_bytes == sizes[4] + sizes[5] + sizes[6]
    anchors = [1, ANCHOR_EVERY + 1, 2 * ANCHOR_EVERY + 1]
    assert [v for v in sizes if os.path.exists(snapshot_path(run, v))] == [anchors[-1]]
    assert max(sizes[v] for v in sizes if v not in anchors) < 0.25 * min(sizes[v] for v in anchors)
    info = json.loads((run.weights / "published_version.json").read_text())
    assert info["chain"] == [anchors[-1], anchors[-1] + 1] and info["file_bytes"] == sizes[anchors[-1] + 1]
    subscriber.close()


def test_a_delta_no_smaller_than_an_anchor_is_written_as_one(run):
    ps = small_model(0)
    with closing(SnapshotPublisher(run, ps)) as publisher:
        publisher.publish(1, 1)
        train_step(ps, 2, lr=1e-5)  # fp32: nearly every element changes its bits
        publisher.publish(2, 2)
        train_step(ps, 3, lr=0.0)  # nothing changes
        publisher.publish(3, 3)
    assert files(run) == ["d00000003.safetensors", "v00000002.safetensors"]  # v1: before the newest anchor


def test_old_files_go_once_a_newer_anchor_is_published_but_those_a_live_worker_reads(run, monkeypatch):
    monkeypatch.setattr(snapshot, "ANCHOR_EVERY", 3)
    ps = small_model(0)
    presence = WorkerPresence(run, 1, interval_s=3600).start()
    try:
        with closing(SnapshotPublisher(run, ps, dtype=torch.bfloat16)) as publisher:
            for version in range(1, 6):
                train_step(ps, version)
                publisher.publish(version, version)
            assert files(run) == ["d00000005.safetensors", "v00000004.safetensors"]
            presence.announce_read((publisher.publisher_id, 4))  # a worker reads the chain from v4 on
            for version in range(6, 9):
                train_step(ps, version)
                publisher.publish(version, version)
            assert files(run) == ["d00000005.safetensors", "d00000006.safetensors", "d00000008.safetensors",
                                  "v00000004.safetensors", "v00000007.safetensors"]
            presence.announce_read(None)
            presence.beat()
            train_step(ps, 9)
            publisher.publish(9, 9)
            assert files(run) == ["d00000008.safetensors", "d00000009.safetensors", "v00000007.safetensors"]
    finally:
        presence.stop()


def test_a_worker_joining_after_the_early_deltas_are_gone_reads_the_anchor_and_the_deltas_after_it(run):
    ps, worker = small_model(0), small_model(1, torch.bfloat16)
    announced = []
    subscriber = make_subscriber(run, on_read=announced.append)
    with closing(SnapshotPublisher(run, ps, dtype=torch.bfloat16)) as publisher:
        for version in range(1, ANCHOR_EVERY + 6):
            train_step(ps, version)
            publisher.publish(version, version)
        assert not snapshot_path(run, 2, anchor=False).exists()
        assert subscriber.sync(worker) == ANCHOR_EVERY + 5 and bits_equal(worker, published(ps))
    assert announced == [(publisher.publisher_id, ANCHOR_EVERY + 1), None]
    subscriber.close()


def corrupt(path: Path) -> str:
    """Flips bits in the new values of one tensor of a delta file (the header and positions intact); its name."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    name = next(n for n in sorted(header) if n.startswith(("dif:", "val:")))
    start, end = header[name]["data_offsets"]
    for i in range(8 + length + start, 8 + length + end, 7):
        data[i] ^= 0x21
    path.write_bytes(bytes(data))
    return name.split(":", 1)[1]


@pytest.mark.parametrize("anchor_from", ["schedule", "asked", "waited_long"])
def test_a_delta_corrupted_on_disk_is_never_applied_and_the_next_anchor_brings_the_worker_back(run, caplog,
                                                                                               anchor_from):
    """The next anchor comes every ANCHOR_EVERY versions, or sooner from a PS that waits for results
    (``while_trainer_waits``: its last version again): workers of other hosts all behind the bad delta would take no
    job past --max_staleness, and the PS, waiting for them, train no step to the next scheduled anchor. It publishes
    one at once where a live worker's heartbeat names the bad delta, else after a long wait."""
    ps, worker = small_model(0), small_model(1, torch.bfloat16)
    presence = WorkerPresence(run, 1, interval_s=3600).start()
    subscriber = make_subscriber(run, on_bad_delta=presence.announce_bad_delta)
    with closing(SnapshotPublisher(run, ps, dtype=torch.bfloat16)) as publisher:
        for version in (1, 2):
            train_step(ps, version)
            publisher.publish(version, version)
        assert subscriber.sync(worker) == 2
        at_2 = published(ps)
        for version in (3, 4):
            train_step(ps, version)
            publisher.publish(version, version)
        before = files(run)
        publisher.while_trainer_waits(False)  # no worker asked yet
        assert files(run) == before
        name = corrupt(snapshot_path(run, 3, anchor=False))
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.weights"):
            assert subscriber.sync(worker) is None  # nothing newer it can trust
            assert subscriber.sync(worker) is None  # said once, not read again
        assert bits_equal(worker, at_2)  # not one element of the bad file written
        [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert line == (f"[weights] v3's delta of {name} does not check out against v2, also after reading the "
                        "anchor v1: keeping v2 until the parameter server publishes a newer anchor"), line
        assert presence.get("bad_delta") == [publisher.publisher_id, 3]
        if anchor_from != "schedule":
            if anchor_from == "asked":
                with caplog.at_level(logging.WARNING, logger="asyncgrpo.weights"):
                    publisher.while_trainer_waits(False)
                assert caplog.records[-1].getMessage() == (
                    "[weights] worker 1 found v3's delta bad on disk: the parameter server publishes v4 again as an "
                    "anchor")
            else:
                presence.announce_bad_delta(None)  # (as a worker that has not said so yet)
                publisher.while_trainer_waits(False)
                assert files(run) == before
                publisher.while_trainer_waits(True)
            assert snapshot_path(run, 4, anchor=True).exists()
            assert subscriber.sync(worker) == 4 and bits_equal(worker, published(ps))
            assert presence.get("bad_delta") is None  # past it
            before = files(run)
            publisher.while_trainer_waits(True)  # v4 is an anchor now: nothing written again
            assert files(run) == before and snapshot_path(run, 4, anchor=True).name in before
        last = 5 if anchor_from != "schedule" else ANCHOR_EVERY + 1  # (after v4's anchor, v5 a delta against v4)
        for version in range(5, last + 1):
            train_step(ps, version)
            publisher.publish(version, version)
        assert subscriber.sync(worker) == last and bits_equal(worker, published(ps))
    presence.stop()
    subscriber.close()


def test_a_delta_that_would_weigh_as_much_as_an_anchor_or_make_its_chain_twice_one_is_an_anchor(run):
    """What a reader reads is the files: a delta's header and checksums weigh too (a model of many small tensors), and
    a reader catching up reads the anchor and every delta after it, so a chain of large deltas is cut short."""
    def changed(model: torch.nn.Module, share: float, step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in model.parameters():  # a rounding step each, at random positions: written as differences
                deltas.flat_bits(p)[torch.rand(p.numel(), generator=gen) < share] += 1

    many = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(50)]).to(torch.bfloat16)
    subscriber = make_subscriber(run)
    with closing(SnapshotPublisher(run, many)) as publisher:
        publisher.publish(1, 1)
        anchor = publisher.published_bytes
        for version in (2, 3):
            changed(many, 0.4, version)  # (the tensors' bytes: 0.8 of the anchor's; their files', more than all)
            publisher.publish(version, version)
            assert publisher.published_bytes == anchor and snapshot_path(run, version).exists()
        assert subscriber.sync(many_copy := torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(50)]).to(
            torch.bfloat16)) == 3 and bits_equal(many_copy, published(many))
    for name in files(run):
        os.unlink(snapshot_dir(run) / name)
    ps, worker = small_model(0, torch.bfloat16), small_model(1, torch.bfloat16)
    with closing(SnapshotPublisher(run, ps)) as publisher:
        publisher.publish(1, 1)
        anchor, chain, kinds = publisher.published_bytes, 0, []
        for version in range(2, 12):
            changed(ps, 0.3, version)
            publisher.publish(version, version)
            kinds.append("v" if snapshot_path(run, version).exists() else "d")
            chain = 0 if kinds[-1] == "v" else chain + publisher.published_bytes
            assert chain <= 2 * anchor and (kinds[-1] == "v" or publisher.published_bytes < anchor)
        assert "v" in kinds[:8] and kinds.count("d") >= 4, kinds  # well before ANCHOR_EVERY
        assert subscriber.sync(worker) == 11 and bits_equal(worker, published(ps))
    subscriber.close()


def test_a_lora_worker_applies_deltas_to_its_adapter_across_threads(run):
    """A PEFT worker's synced tensors are its adapter's parameters, which require grad; a delta's tensors are
    written on two threads, and a thread does not share its caller's torch.no_grad."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    def lora_model() -> torch.nn.Module:
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))
        return get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))

    ps, worker = lora_model(), lora_model()  # (the worker holds float32: the bf16 files' values, widened)
    adapter = [p for p in ps.parameters() if p.requires_grad]
    subscriber = make_subscriber(run)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with closing(SnapshotPublisher(run, ps, dtype=torch.bfloat16)) as publisher:
            for version in (1, 2):
                gen = torch.Generator().manual_seed(version)
                with torch.no_grad():
                    for p in adapter:
                        p.add_(torch.randn(p.shape, generator=gen) * (1e-2 if version == 1 else 1e-5))
                publisher.publish(version, version)
                assert subscriber.sync(worker) == version
            assert len([n for n in load_file(snapshot_path(run, 2, anchor=False)) if n.startswith("was:")]) >= 2
    finally:
        torch.set_num_threads(prev)
    held = {n: p for n, p in worker.named_parameters() if p.requires_grad}
    assert held and all(p.requires_grad for p in held.values())
    for name, p in ps.named_parameters():
        if p.requires_grad:
            assert torch.equal(held[name].detach(), p.detach().to(torch.bfloat16).float())
    subscriber.close()


def test_weights_changed_under_the_reader_are_caught_and_rebuilt_from_the_anchor(run, caplog):
    ps, worker = small_model(0), small_model(1, torch.bfloat16)
    subscriber = make_subscriber(run)
    with closing(SnapshotPublisher(run, ps, dtype=torch.bfloat16)) as publisher:
        train_step(ps, 1)
        publisher.publish(1, 1)
        assert subscriber.sync(worker) == 1
        for version in (2, 3):
            train_step(ps, version)
            publisher.publish(version, version)
        changed = changed_positions(published(ps)["proj.weight"], worker.proj.weight.detach())
        assert changed.numel()  # where v2 or v3 changes proj.weight: the worker's element there is not v1's now
        with torch.no_grad():
            worker.proj.weight.view(-1)[changed[0]] += 1
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.weights"):
            assert subscriber.sync(worker) == 3 and bits_equal(worker, published(ps))
        [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert re.fullmatch(r"\[weights\] the worker's proj.weight is not v(1|2) where v(2|3)'s delta writes: read "
                            r"the anchor v1 and the deltas after it instead \(now v3\)", line), line
    subscriber.close()


def test_a_delta_of_differences_is_checked_against_the_bits_the_worker_holds(run, caplog):
    """A delta written as differences (a rounding step or a few, the usual bf16 change) gives the new bits as the
    held ones plus the file's: the new checksum, updated by the differences alone, would pass whatever the worker
    holds. The file's sum of the bits before at its positions catches a worker that is not the delta's base there."""
    ps, worker = small_model(0, torch.bfloat16), small_model(1, torch.bfloat16)
    subscriber = make_subscriber(run)
    with closing(SnapshotPublisher(run, ps)) as publisher:
        publisher.publish(1, 1)
        assert subscriber.sync(worker) == 1
        with torch.no_grad():
            deltas.flat_bits(ps.proj.weight)[:50] += 1  # a rounding step each: written as differences
        publisher.publish(2, 2)
        assert "dif:proj.weight" in load_file(snapshot_path(run, 2, anchor=False))
        with torch.no_grad():
            deltas.flat_bits(worker.proj.weight)[7] += 3  # where v2 writes, the worker does not hold v1
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.weights"):
            assert subscriber.sync(worker) == 2 and bits_equal(worker, published(ps))
        [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert line == ("[weights] the worker's proj.weight is not v1 where v2's delta writes: read the anchor v1 "
                        "and the deltas after it instead (now v2)"), line
    subscriber.close()


def test_a_worker_in_a_wider_dtype_gets_the_published_values_checked_and_a_narrower_one_is_refused(run, caplog):
    ps, wider = small_model(0), small_model(1)  # the worker holds float32, the files bfloat16
    subscriber = make_subscriber(run)
    with closing(SnapshotPublisher(run, ps, dtype=torch.bfloat16)) as publisher:
        for version in (1, 2, 3):
            train_step(ps, version)
            publisher.publish(version, version)
            with caplog.at_level(logging.WARNING, logger="asyncgrpo.weights"):
                assert subscriber.sync(wider) == version
            assert bits_equal(wider, {k: v.float() for k, v in published(ps).items()})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    subscriber.close()

    narrower, subscriber = small_model(1, torch.bfloat16), make_subscriber(run)
    with closing(SnapshotPublisher(run, ps)) as publisher:  # float32 files
        publisher.publish(4, 4)
        assert subscriber.sync(narrower) == 4  # an anchor: copied, rounded, as every transport does
        with torch.no_grad():
            ps.proj.weight[0, 0] += 1
        publisher.publish(5, 5)
        assert snapshot_path(run, 5, anchor=False).exists()
        with pytest.raises(WeightsMismatch, match=r"^the worker holds proj.weight in torch.bfloat16, narrower than "
                                                  r"the published torch.float32: give the workers the parameter "
                                                  r"server's --dtype and --worker_dtype$"):
            subscriber.sync(narrower)
    subscriber.close()


@pytest.mark.parametrize("fault", ["deleted", "unreadable"])
def test_a_delta_deleted_midway_leaves_the_versions_applied_and_the_next_sync_goes_on(run, monkeypatch, fault):
    """d3 goes (deleted: a newer chain is named now), or cannot be read for a while (EIO): the sync says the
    version the worker holds, d2, not the one it held before (its results would carry the wrong version)."""
    ps, worker = small_model(0), small_model(1, torch.bfloat16)
    subscriber = make_subscriber(run)
    with closing(SnapshotPublisher(run, ps, dtype=torch.bfloat16)) as publisher:
        for version in (1, 2, 3, 4):
            train_step(ps, version)
            publisher.publish(version, version)
            if version == 1:
                assert subscriber.sync(worker) == 1
        real_open = open

        def delete_v3_first(path, *args, **kwargs):
            if str(path).endswith("d00000003.safetensors"):
                monkeypatch.undo()
                if fault == "unreadable":
                    raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
                os.rename(path, f"{path}.away")
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(snapshot, "open", delete_v3_first, raising=False)
        assert subscriber.sync(worker) == 2  # d2 applied, d3 gone: it holds v2
        if fault == "deleted":
            os.rename(f"{snapshot_path(run, 3, anchor=False)}.away", snapshot_path(run, 3, anchor=False))
        assert subscriber.sync(worker) == 4 and bits_equal(worker, published(ps))
    subscriber.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_ps_on_a_gpu_publishes_deltas_a_gpu_worker_applies_bit_identically(run):
    """The PS compares on its GPU (the last version kept there); the worker checks and writes on its own."""
    ps, worker = small_model(0).cuda(), small_model(1, torch.bfloat16).cuda()
    subscriber = make_subscriber(run)
    with closing(SnapshotPublisher(run, ps, dtype=torch.bfloat16)) as publisher:
        for version in range(1, 8):
            with torch.no_grad():
                for p in ps.parameters():
                    p.add_(torch.randn_like(p) * 1e-5)
            publisher.publish(version, version)
            assert subscriber.sync(worker) == version
            assert bits_equal(worker, published(ps))
        assert snapshot_path(run, 7, anchor=False).exists()
    subscriber.close()


# ---------------------------------------------------------------- real processes

def _race(run, tmp_path, fault: str = "none", late_reader_at: int | None = None):
    """A PS process publishing sparse versions flat out with short chains (its old files deleted as it goes), and
    readers as workers on other hosts, each with a host id, heartbeat and log of its own; one joining late."""
    sync = tmp_path / "sync"
    sync.mkdir()
    starts = [0, 0] + ([late_reader_at] if late_reader_at else [])
    procs = [start_script(HERE, "read", str(run.root), str(i + 1), str(sync), str(start),
                          env={"ASYNCGRPO_HOST_ID": f"0000000{i + 1}"},
                          stderr=open(tmp_path / f"reader{i + 1}.log", "w"))  # noqa: SIM115 (the process holds it)
             for i, start in enumerate(starts)]
    ps = start_script(HERE, "publish", str(run.root), "60", str(sync), str(len(procs)), fault)
    return ps, procs, sync


def _finish(ps, procs):
    ps_out, _ = ps.communicate(timeout=PROC_TIMEOUT_S)
    outs = [p.communicate(timeout=PROC_TIMEOUT_S)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return ps_out, [json.loads(o) for o in outs]


@pytest.mark.process
def test_workers_of_two_hosts_and_one_joining_late_read_deltas_while_the_ps_deletes_old_files(run, tmp_path):
    ps, procs, _ = _race(run, tmp_path, late_reader_at=30)
    ps_out, reports = _finish(ps, procs)
    assert ps.returncode == 0, ps_out
    for r in reports:
        assert r["bad"] == [], r["bad"][:5]  # every version synced holds exactly the PS's bits of it
        assert r["last"] == 60 and len(r["versions"]) >= 5, r
    # The late one joined after the first chains were deleted: it read a newer anchor and the deltas after it.
    assert reports[2]["first_chain"] >= 26 and reports[2]["versions"][0] >= 30, reports[2]
    assert len(files(run)) < 20  # old chains were deleted while they read


@pytest.mark.process
def test_a_ps_killed_writing_a_delta_leaves_nothing_torn_and_its_relaunch_is_read(run, tmp_path):
    ps, procs, sync = _race(run, tmp_path, fault="kill@17")
    ps.wait(timeout=PROC_TIMEOUT_S)
    assert ps.returncode == -signal.SIGKILL
    assert [n for n in os.listdir(snapshot_dir(run)) if n.endswith(".tmp")]  # it died mid-write
    assert json.loads((run.weights / "published_version.json").read_text())["version"] == 16
    (sync / "publisher.json").unlink()
    relaunched = start_script(HERE, "publish", str(run.root), "60", str(sync), "2", "none")
    ps_out, reports = _finish(relaunched, procs)
    assert relaunched.returncode == 0, ps_out
    assert not [n for n in os.listdir(snapshot_dir(run)) if n.endswith(".tmp")]  # the relaunch removed it
    for r in reports:
        assert r["bad"] == [] and r["last"] == 60, r


@pytest.mark.process
def test_a_delta_corrupted_on_disk_is_caught_by_the_readers_that_need_it_and_they_catch_up(run, tmp_path):
    ps, procs, _ = _race(run, tmp_path, fault="corrupt@7")
    ps_out, reports = _finish(ps, procs)
    assert ps.returncode == 0, ps_out
    for r in reports:
        assert r["bad"] == [] and r["last"] == 60 and 7 not in r["versions"], r  # never held, nor claimed
    said = [(tmp_path / f"reader{i}.log").read_text() for i in (1, 2)]
    lines = [line for text in said for line in text.splitlines() if "v7's delta of " in line]
    assert lines and all(re.search(r"does not check out against v6(, also after reading the anchor v6)?: keeping "
                                   r"v6 until the parameter server publishes a newer anchor$", line) for line in lines)
    assert all(text.count("v7's delta of ") <= 1 for text in said)  # said once by each


def _publish_main(root, versions, sync_dir, readers, fault) -> None:
    """``fault``: none, kill@V (SIGKILL half-way through writing version V's file) or corrupt@V (V's file
    written with bits flipped in its values, as a disk might return it)."""
    run, sync = RunDir.open(root), Path(sync_dir)
    snapshot.ANCHOR_EVERY = 5
    kind, _, at = fault.partition("@")
    real_save_file = snapshot.save_file

    def save_with_fault(tensors, filename, metadata):
        if metadata["version"] != at:
            return real_save_file(tensors, filename, metadata=metadata)
        if kind == "kill":
            data = save(tensors, metadata=metadata)
            Path(filename).write_bytes(data[:len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        real_save_file(tensors, filename, metadata=metadata)
        corrupt(Path(filename))

    snapshot.save_file = save_with_fault
    model = small_model(0)
    publisher = SnapshotPublisher(run, model, dtype=torch.bfloat16)
    fileops.write_json(sync / "publisher.json", {"id": publisher.publisher_id})
    # The readers that start with it are reading before it publishes (a late one starts at its version).
    wait_for(lambda: len(list(sync.glob("ready-*"))) >= 2, "the first readers to be ready", 90, poll_s=0.01)
    for version in range(1, int(versions) + 1):
        train_step(model, version)
        torch.save(published(model), sync / f"expected-{publisher.publisher_id[:8]}-{version}.pt")
        publisher.publish(version, version)
        time.sleep(0.02)
    wait_for(lambda: len(list(sync.glob("finished-*"))) >= int(readers), "every reader to finish", 90, poll_s=0.05)
    print(json.dumps({"versions": int(versions)}))


def _read_main(root, device, sync_dir, start_at) -> None:
    run, sync = RunDir.open(root), Path(sync_dir)
    if int(start_at):  # a worker joining late
        wait_for(lambda: (fileops.read_json(run.weights / "published_version.json") or {}).get("version", -1)
                 >= int(start_at), f"version {start_at}", 90, poll_s=0.01)
    presence = WorkerPresence(run, int(device), interval_s=0.2).start()
    model = small_model(1, torch.bfloat16)
    chains = []
    subscriber = make_subscriber(run, on_read=lambda chain: (chains.append(chain), presence.announce_read(chain)))
    (sync / f"ready-{device}").touch()
    versions, bad, last, deadline = [], [], None, time.monotonic() + 90
    while time.monotonic() < deadline:
        info = fileops.read_json(sync / "publisher.json")
        got = subscriber.sync(model)
        if got is not None and info is not None:
            expected = torch.load(sync / f"expected-{info['id'][:8]}-{got}.pt")
            if not bits_equal(model, expected):
                bad.append(got)
            versions.append(got)
        if versions and versions[-1] == 60 and info is not None and subscriber._synced[0] == info["id"]:
            last = 60
            break
        time.sleep(0.01 * int(device))
    (sync / f"finished-{device}").touch()
    subscriber.close()
    presence.stop()
    first_chain = next((c[1] for c in chains if c is not None), None)
    print(json.dumps({"versions": versions, "bad": bad, "last": last, "first_chain": first_chain}))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    role, args = sys.argv[1], sys.argv[2:]
    {"publish": _publish_main, "read": _read_main}[role](*args)
