"""The PS's trainer over a stub batch source (ps/batches.py BatchSource), without a queue or workers: it takes
a batch when TRL asks for one, trains each its steps, logs each step's staleness from the batch's weights
versions (and each token's, from the versions that sampled its tokens), and saves checkpoints only where a batch
ends."""

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from helpers import demo_config

from asyncgrpo.inputs import load_model_and_tokenizer, load_reward_funcs, load_train_dataset, write_demo_model_once
from asyncgrpo.run import RunDir
from asyncgrpo.run.checkpoints import LEDGER_FILE
from ps.ledger import GroupsTaken
from ps.pipeline import BatchInTraining, TrainingBatch
from ps.trainer import AsyncGRPOTrainer

COMPLETION = 4


class StubBatches:
    """Hands out the batches it was given, one per take, and counts their steps down as the pipeline does."""

    def __init__(self, batches: list[TrainingBatch]):
        self.todo, self.in_training = list(batches), None
        self.taken_at, self.trained = [], []

    def take(self, step: int) -> TrainingBatch:
        self.taken_at.append(step)
        batch = self.todo.pop(0)
        self.in_training = batch.in_training
        return batch

    def step_trained(self, step: int) -> None:
        self.trained.append(step)
        if self.in_training.trained_one_step():
            self.in_training = None


def a_batch(cfg, vocab: int, weights_version: int, seed: int, tokens_by_version=None) -> TrainingBatch:
    g = torch.Generator().manual_seed(seed)
    rows, groups = cfg.generation_batch_size, cfg.generation_batch_size // cfg.num_generations
    tensors = {"prompt_ids": torch.randint(3, vocab, (rows, 3), generator=g),
               "prompt_mask": torch.ones(rows, 3, dtype=torch.long),
               "completion_ids": torch.randint(3, vocab, (rows, COMPLETION), generator=g),
               "completion_mask": torch.ones(rows, COMPLETION, dtype=torch.long),
               "advantages": torch.randn(rows, generator=g)}
    tensors["num_items_in_batch"] = tensors["completion_mask"].sum()  # TRL's, as a worker's result holds it
    part = GroupsTaken(f"00000{weights_version}_000", weights_version, list(range(groups)), groups, rows,
                       rows * COMPLETION, tokens_by_version)
    return TrainingBatch(tensors, None, BatchInTraining([part], {"reward": 0.5}, cfg.steps_per_job))


def test_the_trainer_trains_each_batch_its_steps_and_saves_only_where_a_batch_ends(tmp_path):
    root = tmp_path / "run"
    run = RunDir.create(root)
    cfg = demo_config(root, "--run_dir", str(root), "--max_steps", "4", "--num_iterations", "2",
                      "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1")
    model, tokenizer = load_model_and_tokenizer(write_demo_model_once(run.root))
    vocab = model.config.vocab_size
    # The second batch's tokens: a quarter sampled by version 1, the rest by version 2 (in-flight updates).
    tokens = cfg.generation_batch_size * COMPLETION
    batches = StubBatches([a_batch(cfg, vocab, weights_version=0, seed=0),
                           a_batch(cfg, vocab, 1, seed=1, tokens_by_version={1: tokens // 4, 2: tokens * 3 // 4})])
    trainer = AsyncGRPOTrainer(cfg, run, model, tokenizer, load_reward_funcs(cfg), load_train_dataset(cfg),
                               batches=batches)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    try:
        trainer.train()
    finally:
        trainer.close()
    assert batches.taken_at == [0, 2] and batches.trained == [1, 2, 3, 4]  # two steps a batch (num_iterations 2)
    lines = [json.loads(line) for line in run.metrics_file.read_text().splitlines()]
    # A step's staleness: the weights it started from (step - 1) minus the batch's weights version.
    assert [(m["step"], m["staleness_max"], m["weights_version"]) for m in lines] == [
        (1, 0, 0), (2, 1, 0), (3, 1, 1), (4, 2, 1)]
    # Each token's: the weights the step starts from minus the version that sampled the token.
    assert [m["token_staleness_mean"] for m in lines] == [0, 1, 0.25, 1.25]
    assert sorted(p.name for p in Path(cfg.output_dir).glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_with_save_strategy_best_evaluations_and_the_saves_they_decide_wait_for_the_batchs_end(tmp_path):
    """With --save_strategy best an evaluation decides a save. One inside a batch (a job of two steps) would save
    weights that trained on a result its checkpoint's ledger does not hold yet: a PS resumed from there trains the
    result again. Evaluations every step, the metric rising: each runs at a batch's end, and so does each save."""
    root = tmp_path / "run"
    run = RunDir.create(root)
    cfg = demo_config(root, "--run_dir", str(root), "--max_steps", "6", "--num_iterations", "2",
                      "--eval_strategy", "steps", "--eval_steps", "1", "--save_strategy", "best",
                      "--metric_for_best_model", "score", "--greater_is_better", "true", "--logging_steps", "1")
    model, tokenizer = load_model_and_tokenizer(write_demo_model_once(run.root))
    vocab = model.config.vocab_size
    batches = StubBatches([a_batch(cfg, vocab, version, seed=version) for version in range(3)])
    trainer = AsyncGRPOTrainer(cfg, run, model, tokenizer, load_reward_funcs(cfg), load_train_dataset(cfg),
                               eval_dataset=load_train_dataset(cfg), batches=batches)
    evaluated = []

    def evaluate(trial, ignore_keys_for_eval, skip_scheduler=False):  # (TRL's own evaluation generates)
        evaluated.append((trainer.state.global_step, trainer.batch_in_training is not None))
        metrics = {"eval_score": float(trainer.state.global_step)}
        trainer.control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, metrics)
        return metrics

    trainer._evaluate = evaluate
    try:
        trainer.train()
    finally:
        trainer.close()
    assert evaluated == [(2, False), (4, False), (6, False)]
    saved = sorted(p.name for p in Path(cfg.output_dir).glob("checkpoint-*"))  # (older ones rotated out)
    assert "checkpoint-6" in saved and set(saved) <= {"checkpoint-2", "checkpoint-4", "checkpoint-6"}, saved


def test_the_final_checkpoint_archives_a_result_split_across_batches_before_its_ledger_counts_it(tmp_path):
    """The final checkpoint counts as consumed a result whose groups were split across batches (its rest never
    trains). Archived only after that ledger was written, a PS killed in between left the result in queue/: relaunched
    at max_steps it was archived unused (the ledger counting a job with no consumed archive), and relaunched with a
    larger --max_steps it was judged again (stale, all its rows thrown again, groups already trained among them)."""
    root = tmp_path / "run"
    run = RunDir.create(root)
    cfg = demo_config(root, "--run_dir", str(root), "--max_steps", "2", "--save_strategy", "steps",
                      "--save_steps", "1", "--logging_steps", "1")
    model, tokenizer = load_model_and_tokenizer(write_demo_model_once(run.root))
    vocab = model.config.vocab_size
    batches = StubBatches([a_batch(cfg, vocab, version, seed=version) for version in range(2)])
    trainer = AsyncGRPOTrainer(cfg, run, model, tokenizer, load_reward_funcs(cfg), load_train_dataset(cfg),
                               batches=batches)
    split = SimpleNamespace(job_id="000009_000")
    trainer.pipeline.leftover = (split, [1])  # group 0 trained in the last batch, group 1 waits for a next one
    archived = []

    def consume(result):
        final_ledger = Path(cfg.output_dir) / "checkpoint-2" / LEDGER_FILE
        archived.append((result.job_id, final_ledger.exists()))
        return True

    trainer.pipeline.queue.consume = consume
    try:
        trainer.train()
    finally:
        trainer.close()
    assert archived == [("000009_000", False)]
    final = json.loads((Path(cfg.output_dir) / "checkpoint-2" / LEDGER_FILE).read_text())
    assert "000009_000" in final["consumed"]
