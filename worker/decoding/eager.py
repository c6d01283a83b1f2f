"""TRL's own generation (``--worker_decoding eager``): its ``_generate_single_turn``, transformers' ``generate`` as TRL
configures it, with the behaviour log-probs read off generate's forwards (worker/behaviour.py) and, with in-flight
updates, newer weights synced through generate's stopping criterion (worker/in_flight.py)."""

from __future__ import annotations

import contextlib

import torch

from worker.behaviour import BehaviourCapture
from worker.decoding import Generation
from worker.in_flight import InFlightWeights
from worker.trl_seam import GENERATE_SINGLE_TURN


class EagerDecoding:
    mode = "eager"

    def __init__(self, trainer):
        self.trainer = trainer

    def generate(self, prompt_ids: list[list[int]], seed: int,
                 in_flight: InFlightWeights | None = None) -> Generation:
        torch.manual_seed(seed)
        capture = BehaviourCapture(self.trainer)
        syncs = in_flight.watching_generate(self.trainer) if in_flight is not None else contextlib.nullcontext()
        with capture.watching_generate(), syncs:
            completion_ids, _ = getattr(self.trainer, GENERATE_SINGLE_TURN)(prompt_ids, None, {},
                                                                             self.trainer.num_generations)
        return Generation(completion_ids, capture, list(in_flight.runs) if in_flight is not None else None)

    def warm_up(self, prompt_ids: list[list[int]]) -> float:
        return 0.0

    def recompiles(self) -> int:
        return 0
