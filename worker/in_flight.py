"""In-flight weight updates (``--in_flight_updates``): newer weights reach a job while it is being generated.

Between decoding steps, every CHECK_EVERY tokens, the worker asks its weight subscriber for a newer version
(one read of ``published_version.json``; nothing else touches the file system) and, when there is one, copies it
into the model's parameters in place: the same storage, so a compiled step or CUDA graph stays valid. Each token
is then sampled by the weights of its step, and its behaviour log-prob, read off that step's logits
(worker/behaviour.py, worker/decoding/graph.py), is the log-prob under those weights: the PS's per-token correction
needs no change. The KV cache of the tokens before a sync stays as the older weights computed it (PipelineRL's
choice; recomputing it is NeMo-RL's option, not implemented).

A generate call's versions are recorded as runs, ``[(first_token, version), ...]``: token ``t`` of every row was
sampled by the version of the last run starting at or before ``t``. The first run's version is the job's
``weights_version``, its oldest token's: the staleness bound and the ledger go by it, as without in-flight
updates.

Where it applies: single-turn generation through transformers' ``generate`` (eager or compiled: a stopping
criterion, which generate calls on the host after each token, is the hook) and the worker's own decoding loop
(``--worker_decoding graph``, its host loop). Not with tools, a rollout function or beam search (``unsupported``).
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from asyncgrpo.events import EventLog
from worker.trl_seam import GenerationPath, generation_path, overriding

CHECK_EVERY = 4  # tokens between two looks for newer weights


class InFlightWeights:
    """The worker's weights during one generate call: synced between steps, with the runs of versions it used."""

    def __init__(self, subscriber, model: torch.nn.Module, events: EventLog, every: int = CHECK_EVERY):
        self.subscriber, self.model, self.events, self.every = subscriber, model, events, every
        self.version: int | None = None  # what the model holds: the worker loop sets it after each of its syncs
        self.runs: list[tuple[int, int]] = []

    def start(self) -> None:
        """A generate call begins, its first token sampled by the weights the model holds (``version``)."""
        self.runs = [(0, self.version)]

    def before_token(self, index: int) -> None:
        """Token ``index`` is about to be sampled (every row's): newer weights, if any, are synced first."""
        if index == 0 or index % self.every:
            return
        started = time.monotonic()
        version = self.subscriber.sync(self.model)
        if version is None:
            return
        self.version = version
        self.runs.append((index, version))
        self.events.emit("weights_synced", weights_version=version, dur_ms=(time.monotonic() - started) * 1e3,
                         bytes=self.subscriber.synced_bytes, in_flight=True, at_token=index)

    @contextlib.contextmanager
    def watching_generate(self, trainer):
        """For the span of a generate call through TRL: the model's ``generate`` (transformers') gets the stopping
        criterion that syncs newer weights between steps, and each call's runs start afresh."""
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)  # the model TRL's transformers path uses
        generate = model.generate

        def generating(*args, **kwargs):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            self.start()
            criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
            criteria.append(_BetweenSteps(self, input_ids.size(1)))
            return generate(*args, stopping_criteria=criteria, **kwargs)

        with overriding(model, "generate", generating):
            yield


class _BetweenSteps(StoppingCriteria):
    """Never stops anything: generate calls it on the host once each new token is in ``input_ids``, before the
    forward that samples the next one."""

    def __init__(self, weights: InFlightWeights, prompt_length: int):
        self.weights, self.prompt_length = weights, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.weights.before_token(input_ids.size(1) - self.prompt_length)
        return torch.zeros(input_ids.size(0), dtype=torch.bool, device=input_ids.device)


def unsupported(trainer) -> str | None:
    """None where in-flight updates apply to this trainer's generation, else why not."""
    if (path := generation_path(trainer)) is not GenerationPath.OWN:
        return path.value
    if (getattr(trainer.generation_config, "num_beams", None) or 1) > 1:
        return "beam search"
    return None
