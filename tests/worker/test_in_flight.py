"""In-flight weight updates on a worker (worker/in_flight.py): weights the PS publishes while a job is being
generated are synced between decoding steps; each token is sampled, and its behaviour log-prob taken, under the
weights of its step, and the result says which versions sampled which tokens.

The PS here publishes a second version that differs from the first in the final norm only: it acts after every
layer, so the KV cache of the tokens before the sync is the same under both, and each token's log-prob can be
recomputed exactly under the version that sampled it. Real transport (mmap), real generation."""

from __future__ import annotations

from contextlib import closing

import pytest
import torch
from helpers import demo_config

from asyncgrpo.events import EventLog
from asyncgrpo.run import RunDir
from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer, repeat_digit_reward
from asyncgrpo.weights import make_publisher, make_subscriber
from worker.decoding.graph import GraphDecoding
from worker.generate import JobInput, build_trainer, generate_jobs
from worker.in_flight import CHECK_EVERY, InFlightWeights
from worker.trl_seam import BEHAVIOUR_LOGPS

pytestmark = pytest.mark.filterwarnings("ignore")
PROMPTS = ["7:", "12 3:", "9 9 9 9:", "0 1:"]
FIRST, SECOND = 3, 7  # the versions the PS publishes before and during the job


def recomputed(trainer, batch) -> torch.Tensor:
    """TRL's log-probs of the batch's completion tokens under the weights the model holds now."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = getattr(type(trainer), BEHAVIOUR_LOGPS)(trainer, trainer.model, ids, mask,
                                                            batch["completion_ids"].size(1))
    return logps


@pytest.mark.parametrize("how", ["one_job", "two_jobs_in_one_call", "graph_decoding"])
def test_weights_published_during_a_job_sample_its_later_tokens_and_the_result_says_which(tmp_path, how):
    tok = build_tokenizer()
    cfg = demo_config(tmp_path, max_completion_length=12, temperature=1.0)
    worker = build_trainer(cfg, build_model(seed=0, tokenizer=tok), tok, [repeat_digit_reward], build_dataset(n=40))
    ps_model = build_model(seed=0, tokenizer=tok)
    norm = ps_model.model.norm.weight
    run = RunDir.create(tmp_path / "run")
    jobs = [JobInput([{"prompt": p} for p in PROMPTS for _ in range(worker.num_generations)], seed=i,
                     fields={"job_id": f"000000_00{i}"}) for i in range(2 if how == "two_jobs_in_one_call" else 1)]
    decoding = None
    if how == "graph_decoding":
        prompt_ids = [list(x) for x in worker._tokenize_prompts(PROMPTS)[0]]
        decoding = GraphDecoding(worker, 1, prompt_ids, compile=False)
    with closing(make_publisher(run, ps_model, "mmap")) as publisher, closing(make_subscriber(run)) as subscriber:
        publisher.publish(version=FIRST, step=FIRST)
        assert subscriber.sync(worker.model) == FIRST
        first_norm = worker.model.model.norm.weight.detach().clone()
        with torch.no_grad():
            norm.mul_(1.5).add_(0.3)
        publisher.publish(version=SECOND, step=SECOND)  # while the worker is busy with its job, say
        in_flight = InFlightWeights(subscriber, worker.model, EventLog.off())
        in_flight.version = FIRST
        outcomes = generate_jobs(worker, jobs, EventLog.off(), decoding, in_flight=in_flight)
    assert in_flight.version == SECOND and torch.equal(worker.model.model.norm.weight, norm)
    for outcome in outcomes:
        assert not isinstance(outcome, Exception), outcome
        assert outcome.token_versions == [[(0, FIRST), (CHECK_EVERY, SECOND)]] * worker.args.generation_batch_size
        batch = outcome.batch
        captured, mask = batch["old_per_token_logps"], batch["completion_mask"].bool()
        assert mask[:, CHECK_EVERY:].any(), "no completion reached the sync"
        under_second = recomputed(worker, batch)
        with torch.no_grad():
            worker.model.model.norm.weight.copy_(first_norm)
        under_first = recomputed(worker, batch)
        with torch.no_grad():
            worker.model.model.norm.weight.copy_(norm)
        before, after = mask.clone(), mask.clone()
        before[:, CHECK_EVERY:], after[:, :CHECK_EVERY] = False, False
        torch.testing.assert_close(captured[before], under_first[before], atol=1e-4, rtol=0)
        torch.testing.assert_close(captured[after], under_second[after], atol=1e-4, rtol=0)
        assert not torch.allclose(under_first[after], under_second[after], atol=1e-3)  # the versions do differ


def test_without_newer_weights_a_job_has_one_version_and_nothing_is_synced(tmp_path):
    tok = build_tokenizer()
    cfg = demo_config(tmp_path, max_completion_length=12)
    worker = build_trainer(cfg, build_model(seed=0, tokenizer=tok), tok, [repeat_digit_reward], build_dataset(n=40))
    run = RunDir.create(tmp_path / "run")
    with closing(make_publisher(run, build_model(seed=0, tokenizer=tok), "mmap")) as publisher, \
            closing(make_subscriber(run)) as subscriber:
        publisher.publish(version=FIRST, step=FIRST)
        assert subscriber.sync(worker.model) == FIRST
        in_flight = InFlightWeights(subscriber, worker.model, EventLog.off())
        in_flight.version = FIRST
        [outcome] = generate_jobs(worker, [JobInput([{"prompt": "7:"}] * worker.num_generations, seed=0)],
                                  EventLog.off(), in_flight=in_flight)
    assert outcome.token_versions == [[(0, FIRST)]] * worker.num_generations and in_flight.version == FIRST
