"""Multi-turn jobs on a worker: TRL's own tool loop, run by a real model that makes real tool calls.

The model is the lookup task's tiny Llama (asyncgrpo/tasks/lookup.py), taught in a few supervised steps
to answer "key K" with a call ``lookup(key=...)`` and then the tool's answer, so that TRL's loop parses
calls, runs the environment's tool, appends its result and generates again. Nothing of the loop is mocked.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import demo_config
from processes.tool_rollouts import taught_tool_model
from trl import GRPOTrainer

from asyncgrpo.events import EventLog
from asyncgrpo.messages import RepeatedFailureLog
from asyncgrpo.tasks.lookup import LookupEnv, build_dataset, build_model
from asyncgrpo.user_code import RolloutHooks
from worker import tools as worker_tools
from worker.generate import JobInput, build_trainer, generate_and_score, generate_jobs
from worker.trl_seam import BEHAVIOUR_LOGPS

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tool_model():
    """(tokenizer, state dict) of a model that calls the tool (tests/processes/tool_rollouts.py)."""
    tok, model = taught_tool_model()
    return tok, {k: v.detach().clone() for k, v in model.state_dict().items()}


def answered_secret(completions, secret, **kwargs) -> list[float]:
    return [float(bool(c) and c[-1].get("content") == str(s)) for c, s in zip(completions, secret, strict=True)]


def make_worker(tmp_path, tool_model, environment=LookupEnv, **overrides):
    tok, state = tool_model
    model = build_model(seed=0, tokenizer=tok)
    model.load_state_dict(state)
    model.config.max_position_embeddings = 256  # as taught_tool_model's
    fields = {"per_device_train_batch_size": 16, "num_generations": 4, "max_completion_length": 16,
              "max_tool_calling_iterations": 2, **overrides}
    cfg = demo_config(tmp_path, **fields)
    return build_trainer(cfg, model, tok, [answered_secret], build_dataset(n=40),
                         hooks=RolloutHooks(environment_factory=environment))


def job_rows(trainer):
    dataset = trainer.train_dataset
    return [dataset[i // trainer.num_generations] for i in range(trainer.args.generation_batch_size)]


def forward_logps(trainer, batch):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask,
                                                                     batch["completion_ids"].size(1))
    return logps


# Captured during generation (one token a step, through the KV cache) against one forward pass over the whole
# completion: float32 sums in other orders. Measured over 10 jobs: the two differ by up to 2.1e-6 of the log-probs'
# norm, elementwise by up to 3.3e-5 (on a token of log-prob -0.004, beyond any fixed 1e-5); a log-prob 1e-3 off on
# one token of ~120 moves them by ~4e-5 of it.
LOGP_RTOL = 2e-5


def assert_close_to_norm(got: torch.Tensor, expected: torch.Tensor, rtol: float = LOGP_RTOL) -> None:
    off, norm = float((got - expected).norm()), float(expected.norm())
    assert off <= rtol * norm, f"|got - expected| = {off:.3g}, {off / norm:.3g} of |expected| = {norm:.3g}"


class RecordedEvents(EventLog):
    def __init__(self):
        super().__init__(None, "test", "worker", "cpu")
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": event, **fields})


def test_a_multi_turn_job_runs_trls_tool_loop_and_captures_behaviour_logps_of_model_tokens_only(tmp_path, tool_model):
    trainer = make_worker(tmp_path, tool_model)
    events = RecordedEvents()
    forward_passes = []
    trainer.__dict__[BEHAVIOUR_LOGPS] = lambda *a, **k: forward_passes.append(1) or GRPOTrainer.__dict__[
        BEHAVIOUR_LOGPS](trainer, *a, **k)
    batch, metrics = generate_and_score(trainer, job_rows(trainer), events, seed=0, job_id="j1")
    del trainer.__dict__[BEHAVIOUR_LOGPS]

    tool_mask = batch["tool_mask"]
    called = (tool_mask == 0).any(dim=1)
    assert called.sum() >= 4, "the model made tool calls, TRL's loop ran them"
    assert metrics["tools/call_frequency"] > 0
    assert not forward_passes, "captured across turns: no second forward pass"
    behaviour, model_tokens = batch["old_per_token_logps"], (batch["completion_mask"] * tool_mask).bool()
    expected = forward_logps(trainer, batch)
    assert_close_to_norm(behaviour[model_tokens], expected[model_tokens])
    assert (behaviour[~model_tokens] == 0).all(), "no behaviour log-prob on tool-result tokens or padding"
    turns = [e for e in events.records if e["event"] == "generate_turn_end"]
    tools = [e for e in events.records if e["event"] == "tools_end"]
    assert [t["turn"] for t in turns] == list(range(len(turns))) and len(turns) >= 2
    assert turns[0]["rows"] == len(job_rows(trainer)) and turns[1]["rows"] == int(called.sum())
    assert sum(t["calls"] for t in tools) >= int(called.sum()) and all(t["job_id"] == "j1" for t in tools)


class RaisingLookup(LookupEnv):
    def lookup(self, key: int) -> str:
        """Look up the secret digit stored under a key.

        Args:
            key: The key to look up.
        """
        raise KeyError("the vault is closed")


HELD = threading.Event()  # set when the test ends: the abandoned calls then return


class HangingLookup(LookupEnv):
    def lookup(self, key: int) -> str:
        """Look up the secret digit stored under a key.

        Args:
            key: The key to look up.
        """
        HELD.wait(3)  # past the 0.2 s bound: abandoned, unless the bound is broken (then the test fails, slowly)
        return "too late"


def tool_results(trainer) -> list[str]:
    completions = trainer._logs["completion"]
    return [m["content"] for c in completions for m in c if isinstance(m, dict) and m.get("role") == "tool"]


class ToolsWithoutLookup:
    """Tools of another name than the one the model calls."""

    def reset(self, **row) -> None:
        pass

    def fetch(self, key: int) -> str:
        """Fetch the value stored under a key.

        Args:
            key: The key to fetch.
        """
        return "0"


@pytest.mark.parametrize("environment, expected, logged", [
    (RaisingLookup, "the vault is closed", "[tools] lookup: KeyError: 'the vault is closed' (the first such failure"),
    (HangingLookup, "no result within 0.2 s", "[tools] lookup: no result within 0.2 s (--tool_timeout_s) (the first"),
    (ToolsWithoutLookup, "Tool lookup not found.",
     "[tools] the model called 'lookup', which is not a tool of this run (its tools: fetch) (the first")])
def test_a_tool_that_raises_hangs_or_is_not_there_gives_its_error_as_the_result_and_is_counted_and_logged(
        tmp_path, tool_model, environment, expected, logged, monkeypatch, caplog):
    errors = RepeatedFailureLog(worker_tools.log, "tools", every_s=3600)
    monkeypatch.setattr(worker_tools, "TOOL_ERRORS", errors)
    abandoned = worker_tools.AbandonedCalls(first_said=1000)  # (said apart: the test below)
    monkeypatch.setattr(worker_tools, "ABANDONED", abandoned)
    trainer = make_worker(tmp_path, tool_model, environment, tool_timeout_s=0.2, max_tool_calling_iterations=1,
                          max_completion_length=128)
    events = RecordedEvents()
    HELD.clear()
    try:
        with caplog.at_level("WARNING", logger="asyncgrpo.worker"):
            batch, metrics = generate_and_score(trainer, job_rows(trainer), events, seed=0, job_id="j1")
        results = tool_results(trainer)
    finally:
        HELD.set()
    assert len(results) >= 2 and all(expected in r for r in results), results[:3]
    assert metrics["tools/failure_frequency"] == 1.0
    tools = [e for e in events.records if e["event"] == "tools_end"]
    assert sum(t["failed"] for t in tools) == sum(t["calls"] for t in tools) == len(results)
    assert sum(t["timed_out"] for t in tools) == (len(results) if environment is HangingLookup else 0)
    assert (batch["tool_mask"] == 0).any()
    # Its text in the log once; the repeats counted for the next line.
    lines = [r.getMessage() for r in caplog.records if "[tools]" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(logged), lines
    assert sum(errors.repeats.values()) == len(results) - 1


def test_repeated_tool_failures_are_logged_together_once_the_interval_has_passed(caplog):
    now = [0.0]
    errors = RepeatedFailureLog(worker_tools.log, "tools", every_s=60, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="asyncgrpo.worker"):
        for t in range(100):  # one failure a second, of two kinds
            now[0] = float(t)
            errors.failed("lookup: KeyError: 'closed'" if t % 4 else "lookup: no result within 30 s")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:2] == ["[tools] lookup: no result within 30 s (the first such failure; repeats are counted and "
                         "logged every 60 s)", "[tools] lookup: KeyError: 'closed' (the first such failure; repeats "
                         "are counted and logged every 60 s)"]
    assert lines[2:] == ["[tools] failed again in the last 60 s: lookup: KeyError: 'closed' (x45); "
                         "lookup: no result within 30 s (x15)"]  # from t=2 to t=61


def test_failures_whose_text_differs_each_time_are_logged_at_once_up_to_a_number_of_kinds_then_counted(caplog):
    """An error whose message names its prompt makes each failure a kind of its own: past MAX_KINDS they are
    counted, and the periodic line names the commonest and sums the others."""
    now = [0.0]
    errors = RepeatedFailureLog(worker_tools.log, "jobs", every_s=60, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="asyncgrpo.worker"):
        for t in range(80):  # one failure a second, each with its own text
            now[0] = float(t)
            errors.failed(f"cannot parse '{t}:'")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == RepeatedFailureLog.MAX_KINDS + 1
    assert lines[-1] == ("[jobs] failed again in the last 60 s: " + "; ".join(f"cannot parse '{t}:' (x1)" for t in
                         range(20, 25)) + "; and 55 other failure(s) of 55 kind(s)")  # t=20..79, from t=19


class BrokenReset(LookupEnv):
    def reset(self, **row) -> None:
        raise RuntimeError("the sandbox did not start")


def test_an_environment_whose_reset_raises_fails_that_job_only(tmp_path, tool_model):
    trainer = make_worker(tmp_path, tool_model)
    rows = job_rows(trainer)
    trainer.environment_factories = {None: BrokenReset}
    trainer._environment_pool = {None: [BrokenReset()]}
    outcome = generate_jobs(trainer, [JobInput(rows, seed=0)], EventLog.off())
    assert isinstance(outcome[0], RuntimeError) and "the sandbox did not start" in str(outcome[0])


class HangingReset(LookupEnv):
    def reset(self, **row) -> None:
        HELD.wait(3)


class HangingReward(LookupEnv):
    def get_reward(self) -> float:
        HELD.wait(3)
        return 1.0


@pytest.mark.parametrize("environment, expected", [
    (HangingReset, "HangingReset.reset(): no result within 0.2 s (--tool_timeout_s)"),
    (HangingReward, "HangingReward.get_reward(): no result within 0.2 s (--tool_timeout_s)")])
def test_an_environment_whose_reset_or_reward_hangs_fails_that_job_within_the_tool_bound(tmp_path, tool_model,
                                                                                         environment, expected):
    """TRL has no bound on reset() or get_reward(): without one, a hung call would hold the worker and its job
    for good (its heartbeat goes on, so the lease never takes the job back)."""
    trainer = make_worker(tmp_path, tool_model, environment, tool_timeout_s=0.2, max_tool_calling_iterations=1)
    HELD.clear()
    try:  # (unbounded, the call would return after 3 s and the job succeed)
        outcome = generate_jobs(trainer, [JobInput(job_rows(trainer), seed=0)], EventLog.off())
    finally:
        HELD.set()
    assert isinstance(outcome[0], TimeoutError) and expected in str(outcome[0]), outcome


def two_turn_rollout(prompts, trainer):
    """A user's own rollout (GRPOTrainer's rollout_func): generate, append the environment's reply " 5:" (tokens
    the model did not generate: env_mask 0), generate again; TRL's signature and keys."""
    tok = trainer.processing_class
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    reply = tok(" 5:")["input_ids"]
    completion_ids, env_mask = [], []
    for ids in prompt_ids:
        first = trainer.model.generate(torch.tensor([ids]), do_sample=True, max_new_tokens=3,
                                       pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        context = ids + first + reply
        second = trainer.model.generate(torch.tensor([context]), do_sample=True, max_new_tokens=3,
                                        pad_token_id=tok.pad_token_id)[0, len(context):].tolist()
        completion_ids.append(first + reply + second)
        env_mask.append([1] * len(first) + [0] * len(reply) + [1] * len(second))
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "env_mask": env_mask,
            "logprobs": [[0.0] * len(c) for c in completion_ids]}


def test_a_rollout_function_runs_on_the_worker_and_its_env_mask_becomes_the_tool_mask(tmp_path, caplog):
    from asyncgrpo.tasks.demo import build_dataset as demo_dataset
    from asyncgrpo.tasks.demo import build_model as demo_model
    from asyncgrpo.tasks.demo import build_tokenizer as demo_tokenizer
    from asyncgrpo.tasks.demo import repeat_digit_reward

    tok = demo_tokenizer()
    cfg = demo_config(tmp_path, per_device_train_batch_size=8, num_generations=4)
    trainer = build_trainer(cfg, demo_model(seed=0, tokenizer=tok), tok, [repeat_digit_reward], demo_dataset(n=40),
                            hooks=RolloutHooks(rollout_func=two_turn_rollout))
    rows = job_rows(trainer)
    with caplog.at_level("INFO", logger="asyncgrpo.worker"):
        batch, _ = generate_and_score(trainer, rows, EventLog.off(), seed=0)
    reply = len(tok(" 5:")["input_ids"])
    assert ((batch["tool_mask"] == 0).sum(dim=1) == reply).all()
    assert "behaviour log-probs from a second forward pass: rollout_func" in caplog.text
    model_tokens = (batch["completion_mask"] * batch["tool_mask"]).bool()
    expected = forward_logps(trainer, batch)
    torch.testing.assert_close(batch["old_per_token_logps"][model_tokens], expected[model_tokens])
    assert "sampling_per_token_logps" not in batch, "the rollout's own log-probs are not taken as vLLM's"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stop_request_cuts_a_running_tool_call_and_refuses_the_next(monkeypatch, kind):
    """Within the bound (600 s here), a worker asked to stop does not wait for a tool that hangs."""
    import asyncio

    stopping = threading.Event()
    monkeypatch.setattr(worker_tools, "STOPPING", stopping)
    entered, never = threading.Event(), threading.Event()

    def hangs():
        entered.set()
        never.wait(60)

    async def hangs_async():
        entered.set()
        await asyncio.sleep(60)

    def call():
        if kind == "sync":
            return worker_tools.call_within(600, "lookup", hangs)
        return asyncio.run(worker_tools.await_within(600, "lookup", hangs_async()))

    threading.Thread(target=lambda: entered.wait(60) and stopping.set(), daemon=True).start()
    try:
        with pytest.raises(worker_tools.WorkerStopping, match="lookup: cut, the worker is stopping"):
            call()
        with pytest.raises(worker_tools.WorkerStopping, match="lookup: not called, the worker is stopping"):
            call()
    finally:
        never.set()


def test_sync_tool_calls_cut_by_the_bound_are_counted_while_their_threads_run_and_said_as_they_grow(
        monkeypatch, caplog):
    """A Python thread cannot be stopped: a sync call past --tool_timeout_s goes on in its thread. A tool that never
    returns leaked one a call in silence (a worker held 40 threads after 100 s); they are counted until they return,
    and said in a [tools] line as their number doubles."""
    abandoned = worker_tools.AbandonedCalls(first_said=2)
    monkeypatch.setattr(worker_tools, "ABANDONED", abandoned)
    release = threading.Event()
    with caplog.at_level("WARNING", logger="asyncgrpo.worker"):
        for _ in range(3):
            with pytest.raises(worker_tools.ToolTimeout):
                worker_tools.call_within(0.05, "lookup", release.wait)
        assert worker_tools.call_within(5, "quick", lambda: 7) == 7
    assert abandoned.running == 3
    assert [r.getMessage() for r in caplog.records] == [
        "[tools] 2 tool calls cut by --tool_timeout_s still run in this worker's threads (the last: lookup); a Python "
        "thread cannot be stopped: a tool that never returns leaks one a call, until the worker restarts"]
    release.set()
    deadline = time.monotonic() + 10
    while abandoned.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert abandoned.running == 0
