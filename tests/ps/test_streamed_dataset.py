"""A streamed dataset (--dataset_streaming) in the PS's producer: its generation batches are those TRL's own
training dataloader reads from the same stream, each epoch reshuffled with every prompt in it, a resumed producer
throws on exactly where its journal says, and a stream too short for one batch is refused in one line.

Rows carry an ``id`` column, so a batch is compared by which rows it holds, in order."""

import itertools
import json

import pytest
from datasets import IterableDataset
from helpers import demo_config, demo_flags

from asyncgrpo.config import ConfigError
from asyncgrpo.inputs import load_model_and_tokenizer, load_reward_funcs, load_train_dataset, write_demo_model_once
from asyncgrpo.jobqueue import JobQueue
from asyncgrpo.run import fileops
from ps.pipeline import JobPipeline
from worker.generate import build_trainer

PROMPTS = 40
G = 4  # with the demo's batch of 32 rows: 8 prompts a batch, 5 batches an epoch


def streamed_config(tmp_path, prompts: int = PROMPTS, *flags: str):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i % 10}:", "id": i}) + "\n" for i in range(prompts)))
    return demo_config(tmp_path, *demo_flags(), "--dataset_name", str(data), "--dataset_streaming", "true",
                       "--num_generations", str(G), "--max_steps", "100", *flags)


def ids(batch) -> list[int]:
    return [row["id"] for row in batch]


def producer_batches(cfg, run, dataset):
    return JobPipeline(cfg, run, JobQueue(run), dataset).producer.generation_batches()


def test_a_stream_is_drawn_in_the_order_trls_own_dataloader_reads_it(tmp_path, run):
    cfg = streamed_config(tmp_path)
    dataset = load_train_dataset(cfg)
    assert isinstance(dataset, IterableDataset)
    model, tokenizer = load_model_and_tokenizer(write_demo_model_once(tmp_path), cfg)
    trl = build_trainer(cfg, model, tokenizer, load_reward_funcs(cfg), dataset).get_train_dataloader()
    per_epoch = PROMPTS // (cfg.generation_batch_size // G)
    expected = [ids(batch) for batch in itertools.islice(trl, per_epoch)]
    drawn = [ids(batch) for batch in itertools.islice(producer_batches(cfg, run, dataset), per_epoch)]
    assert drawn == expected
    assert all(batch[i] == batch[i - i % G] for batch in drawn for i in range(len(batch)))  # groups of G
    assert drawn[0] != sorted(drawn[0]), "shuffled, as TRL shuffles with --shuffle_dataset (its default)"


def test_each_epoch_of_a_stream_is_reshuffled_and_holds_every_prompt(tmp_path, run):
    cfg = streamed_config(tmp_path)
    per_epoch = PROMPTS // (cfg.generation_batch_size // G)
    batches = [ids(b) for b in itertools.islice(producer_batches(cfg, run, load_train_dataset(cfg)), 2 * per_epoch)]
    first, second = sum(batches[:per_epoch], []), sum(batches[per_epoch:], [])
    assert sorted(set(first)) == sorted(set(second)) == list(range(PROMPTS))
    assert first != second


def test_a_resumed_producer_throws_on_from_its_journal_with_no_row_twice_or_skipped(tmp_path, run):
    """Resume reads the stream again from its start and skips the batches the journal says were drawn, across an
    epoch's end: what a new process draws next is the batch an uninterrupted producer would have drawn."""
    cfg = streamed_config(tmp_path)
    uninterrupted = [ids(b) for b in itertools.islice(producer_batches(cfg, run, load_train_dataset(cfg)), 9)]
    fileops.write_json(run.producer_journal, {"batches_drawn": 7, "last_job_id": None, "last_rows": [], "owed": [],
                                              "set_aside": [], "prompts_skipped": 0})
    resumed = JobPipeline(cfg, run, JobQueue(run), load_train_dataset(cfg)).producer  # as a new PS loads it
    resumed.load_state(None)
    assert [ids(next(resumed._batches)) for _ in range(2)] == uninterrupted[7:9]


@pytest.mark.parametrize("streaming", ["true", "false"])
def test_fewer_prompts_than_one_generation_batch_are_refused_in_one_line(tmp_path, streaming):
    cfg = streamed_config(tmp_path, 7, "--dataset_streaming", streaming)
    with pytest.raises(ConfigError, match=r"prompts\.jsonl: fewer than 8 prompts in split 'train': not one "
                                          r"generation batch \(32 rows, 4 generations each\)$"):
        load_train_dataset(cfg)
