"""A streamed dataset (--dataset_streaming) across a SIGKILLed PS, as real processes: the PS is killed inside a
checkpoint save, a new PS resumes the run, and in the end no row was trained twice, none drawn was skipped, and
the rows came in the order TRL reads the stream."""

import collections
import itertools
import json
import signal

from datasets import load_dataset
from helpers import (
    assert_exactly_once,
    demo_flags,
    expect_exit,
    read_json,
    run_flags,
    start_faulty_ps,
    start_process,
)
from trl.trainer.utils import repeat_iterable_dataset

from asyncgrpo.jobqueue.names import done_reason
from asyncgrpo.run import fileops

TIMEOUT_S = 600
PROMPTS = 400  # more than the run draws: within one epoch, a row trained twice is a row drawn twice
G, ROWS = 4, 32  # 8 prompts a job
STEPS = 20


def payloads(folder):
    for path in sorted(folder.iterdir()):
        if path.suffix == ".pt":
            yield path.name, fileops.load_payload(path)


def test_a_ps_killed_on_a_streamed_dataset_resumes_with_no_row_trained_twice_or_skipped(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i % 10}:", "id": i}) + "\n" for i in range(PROMPTS)))
    args = [*demo_flags(), "--dataset_name", str(data), "--dataset_streaming", "true", "--num_generations", str(G),
            "--max_steps", str(STEPS), *run_flags(save_steps=3)]
    run_root = tmp_path / "run"
    ps = start_faulty_ps(run_root, tmp_path / "ps.log", "kill-mid-save", 9, *args)
    workers = [start_process(run_root, tmp_path / f"w{i}.log", "worker", "--device", str(i), *args) for i in (1, 2)]
    try:
        expect_exit(ps, -signal.SIGKILL, tmp_path / "ps.log", TIMEOUT_S)
        ps = start_process(run_root, tmp_path / "ps.log", "ps", *args)  # resume
        expect_exit(ps, 0, tmp_path / "ps.log", TIMEOUT_S)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        codes = [worker.wait(timeout=120) for worker in workers]
    assert codes == [0, 0]
    assert_exactly_once(run_root, jobs=STEPS)

    # The stream as TRL's dataloader reads it (tests/ps/test_streamed_dataset.py checks the producer against it).
    journal = read_json(run_root / "producer.json")
    shuffled = load_dataset("json", data_files=str(data), streaming=True)["train"].shuffle(seed=0)
    stream = repeat_iterable_dataset(shuffled, mini_repeat_count=G, batch_size=ROWS // G)
    drawn = [row["id"] for row in itertools.islice(stream, journal["batches_drawn"] * ROWS)]
    assert len(drawn) == journal["batches_drawn"] * ROWS > STEPS * ROWS

    jobs, trained = {}, collections.Counter()
    for folder in (run_root / "done", run_root / "queue"):
        for name, payload in payloads(folder):
            rows = [row["id"] for row in payload["data"]["rows"]]
            if payload["kind"] == "job":
                jobs[payload["job_id"]] = rows
            elif done_reason(name) == "consumed":
                trained.update(rows)
    owed = [row["id"] for entry in journal["owed"] for row in entry["rows"]]
    # Every row drawn went out in a job (or is owed one), and nothing else did: none skipped across the kill.
    assert set(itertools.chain(*jobs.values(), owed)) == set(drawn)
    # Each row trained was trained once, as one group of G; STEPS jobs of ROWS rows.
    assert set(trained.values()) == {G} and sum(trained.values()) == STEPS * ROWS
    assert jobs[min(jobs)] == drawn[:ROWS], "the first job holds the stream's first batch"
