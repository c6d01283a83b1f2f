"""The worker's one seam into TRL's private methods: every TRL internal a worker touches is named here, and
``scoring_one_job`` installs every override of TRL's generation and scoring for one job, in one stated order.

A worker runs TRL's own ``_generate_and_score_completions`` on a job's rows (worker/generate.py), and needs
more from that call than its return value: when generation ended (the scoring time), each completion's reward
before TRL normalises it, the behaviour log-probs (worker/behaviour.py), each turn's timing and the tools held
to ``--tool_timeout_s`` (worker/tools.py), and, for a job generated in a call shared with other jobs, TRL's
generation replaced by that call's share. For the span of one job, instance attributes on the trainer shadow
the class's methods (and are removed afterwards):

    _generate             timed (the ``generate`` span, then ``score_start``); with tools, the batch's tools
                          bounded first and the log-probs TRL's tool loop assembled taken out of its output;
                          with a rollout function, its log-probs dropped (not known to be the policy's)
    _generate_single_turn called by TRL's ``_generate`` once, or once a turn in its tool loop; from the outside
                          in: the turn timing (tools), the per-turn behaviour capture (tools), then TRL's own
                          method, or the replay of a shared call's share (``Pregenerated``)
    _calculate_rewards    its output kept (``ScoredJob.rewards_per_func``)

Single-turn behaviour capture watches the model's ``generate`` (a transformers method, not TRL's) for the
same span. These internals, and what asyncgrpo reads of each, are pinned by tests/test_trl_contract.py, which
also checks that no other worker module names a TRL internal itself.
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass

from trl import GRPOTrainer

from asyncgrpo.events import EventLog

# TRL's GRPOTrainer internals the worker calls, overrides or reads (trl 1.16).
GENERATE_AND_SCORE = "_generate_and_score_completions"
GENERATE = "_generate"
GENERATE_SINGLE_TURN = "_generate_single_turn"  # one model.generate call over token ids: a turn
CALCULATE_REWARDS = "_calculate_rewards"  # its loop variable reward_func_name names the function being called
BEHAVIOUR_LOGPS = "_get_per_token_logps_and_entropies"
TOKENIZE_PROMPTS = "_tokenize_prompts"
METRICS = "_metrics"  # {"train": {name: [values]}}
COMPLETION_LOGS = "_logs"  # TRL's completions table: prompt, completion, rewards (per function), advantages, extra
SYNC_TOOLS, ASYNC_TOOLS = "_sync_tool_dicts", "_async_tool_dicts"  # per rollout, {name: callable}, built per batch
ENVIRONMENT_POOL = "_environment_pool"  # {name: [environment instances]}, drawn from for each batch
TRL_INTERNALS = (GENERATE_AND_SCORE, GENERATE, GENERATE_SINGLE_TURN, CALCULATE_REWARDS, BEHAVIOUR_LOGPS,
                 TOKENIZE_PROMPTS, METRICS, COMPLETION_LOGS, SYNC_TOOLS, ASYNC_TOOLS, ENVIRONMENT_POOL)


class GenerationPath(enum.Enum):
    """Which of TRL's ways of generating a trainer's jobs take: every feature of the worker that depends on it
    (decoders, behaviour capture, in-flight updates, jobs per call) asks ``generation_path``."""

    OWN = "one generate call per job, by the worker's decoder, replayed into TRL's scoring"
    TURNS = "tools, an environment or a rollout function (TRL's turns, or the user's loop)"
    TRL_ENGINE = "TRL's own engine (vLLM or transformers' continuous batching)"


def generation_path(trainer: GRPOTrainer) -> GenerationPath:
    if trainer.tools or trainer.rollout_func is not None:
        return GenerationPath.TURNS
    if trainer.use_vllm or trainer.use_transformers_continuous_batching:
        return GenerationPath.TRL_ENGINE
    return GenerationPath.OWN


@dataclass
class Pregenerated:
    """One job's share of a generate call made for several jobs: what TRL's ``_generate_single_turn`` returns for
    its rows, and the behaviour log-probs captured for them (a worker.behaviour.BehaviourCapture)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    capture: object


@dataclass
class ScoredJob:
    """What the seam saw of one job's TRL call, besides the batch it returned."""

    rewards_per_func: object = None  # torch.Tensor (completions, reward functions): _calculate_rewards' last output
    generated_at: float | None = None  # time.monotonic() when generation ended and scoring began


@contextlib.contextmanager
def overriding(owner, name: str, replacement):
    """``owner.name`` is ``replacement`` for the span; then what it was (an instance attribute set before, or
    the class's own again)."""
    own = owner.__dict__.get(name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


@contextlib.contextmanager
def scoring_one_job(trainer: GRPOTrainer, events: EventLog, job_fields: dict, capture, turns=None,
                    pregenerated: Pregenerated | None = None, in_flight=None):
    """For the span of one ``_generate_and_score_completions`` call: the overrides above, in that order.
    ``capture``: a BehaviourCapture (one generate call) or MultiTurnCapture (tools); ``turns``: the job's
    RolloutTurns with tools, else None; ``pregenerated``: the job's share of a shared generate call, else None;
    ``in_flight``: a worker.in_flight.InFlightWeights, whose stopping criterion the model's generate gets."""
    seen = ScoredJob()
    generate, calculate_rewards = getattr(trainer, GENERATE), getattr(trainer, CALCULATE_REWARDS)

    def generating(*args, **kwargs):
        if turns is not None:  # the tools of this batch exist now (TRL builds them before calling _generate)
            turns.bounding_tools(getattr(trainer, SYNC_TOOLS, None) or [], getattr(trainer, ASYNC_TOOLS, None))
        with events.span("generate", **job_fields) if pregenerated is None else contextlib.nullcontext():
            out = generate(*args, **kwargs)
        if turns is not None:
            out = capture.received(out)
        elif trainer.rollout_func is not None:  # its log-probs are not known to be the policy's, as TRL computes
            out = out[:4] + (None,) + out[5:]  # them: TRL would take them as vLLM's; the forward pass replaces them
        seen.generated_at = time.monotonic()
        events.emit("score_start", **job_fields)
        return out

    def keeping_rewards(*args, **kwargs):
        seen.rewards_per_func = calculate_rewards(*args, **kwargs)
        return seen.rewards_per_func

    single_turn = getattr(trainer, GENERATE_SINGLE_TURN)
    if pregenerated is not None:
        single_turn = _replay(pregenerated)
    if turns is not None:
        single_turn = turns.timed(capture.capturing(single_turn))
    with contextlib.ExitStack() as stack:
        if turns is not None:
            stack.callback(turns.finish)
        if pregenerated is None and turns is None:
            stack.enter_context(capture.watching_generate())  # the model's generate, for the job's one call
            if in_flight is not None:  # newer weights between its steps (worker/in_flight.py)
                stack.enter_context(in_flight.watching_generate(trainer))
        stack.enter_context(overriding(trainer, GENERATE_SINGLE_TURN, single_turn))
        stack.enter_context(overriding(trainer, GENERATE, generating))
        stack.enter_context(overriding(trainer, CALCULATE_REWARDS, keeping_rewards))
        yield seen


def _replay(pregenerated: Pregenerated):
    """TRL's ``_generate_single_turn`` for one job of a shared call: its share, after checking that TRL asks
    for the prompts that call generated for."""

    def replay(prompt_ids, *_args, **_kwargs):
        if [list(x) for x in prompt_ids] != pregenerated.prompt_ids:
            raise RuntimeError("the job's prompts tokenized otherwise than for the shared generate call")
        return pregenerated.completion_ids, None

    return replay
