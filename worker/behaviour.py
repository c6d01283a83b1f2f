"""Behaviour log-probs: the log-prob of each sampled token under the weights that sampled it,
read off generate's own forward passes (BehaviourCapture), so that the worker need not run a
second forward pass over every completion.

The decoding forwards are watched in two ways: a forward hook on the generating model (every
eager forward: the prefill always, each decoding step in eager decoding), and the observer of
the compiled decoding step (worker/decoding/compiled.py: a forward hook would be traced into the
compiled graph). Both feed the same bookkeeping.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.profiler import record_function
from trl import GRPOTrainer

from worker.decoding.compiled_step import CompiledDecodeStep, generating_model
from worker.trl_seam import overriding


class BehaviourCapture:
    """The log-prob of each sampled token under the weights that sampled it, read off generate's own forwards.

    TRL recomputes behaviour log-probs as ``log_softmax(logits / temperature)`` at each
    completion token, from the model's logits before any logits processor (no top-k, top-p
    or repetition penalty), and the PS's loss compares them with its own computed the same
    way. The logits the decoding loop feeds to its processors are those same raw logits, so
    the quantity is captured here without a second forward pass.

    While TRL's ``_generate`` runs (``watching_generate``), the model TRL generates with
    gets ``generate`` wrapped as an instance attribute, and while that runs, a forward hook.
    Each decoding forward's last-position logits are kept until the next forward, whose
    input_ids end with the token they sampled; the last token's come from generate's output.
    That keeps one (batch, vocab) row set alive, not one per step.

    Anything unexpected (generate called twice or not at all, decoding forwards that do not
    match the generated tokens one to one, rows that do not line up with TRL's batch) leaves
    ``per_token_logps`` returning None, with the reason in ``why_not``; the caller then
    falls back to the forward pass. Configurations known not to generate through a single
    ``model.generate`` call are not watched at all.
    """

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer
        self.temperature = trainer.args.temperature  # what TRL's fused LM head divides by
        self.why_not: str | None = not_captured(trainer)
        self.generate_calls = 0
        self.logps: torch.Tensor | None = None  # (B, new tokens)
        self.tokens: torch.Tensor | None = None  # (B, new tokens), the tokens they were gathered at
        # During one generate call: the previous forward's last-position logits, and what was gathered so far.
        self._pending: torch.Tensor | None = None
        self._step_logps: list[torch.Tensor] = []
        self._step_tokens: list[torch.Tensor] = []

    @staticmethod
    def unsupported(trainer: GRPOTrainer) -> str | None:
        # TRL's other generation paths do not call model.generate once per turn over the batch; beam search
        # feeds batch x beams rows to the model. (Tools: one call per turn, see MultiTurnCapture.)
        if trainer.use_vllm:
            return "use_vllm"
        if trainer.use_transformers_continuous_batching:
            return "use_transformers_continuous_batching"
        if trainer.rollout_func is not None:
            return "rollout_func"
        if (getattr(trainer.generation_config, "num_beams", None) or 1) > 1:  # None: transformers' default, 1
            return "num_beams > 1"
        return None

    # ------------------------------------------------------------------ during generation

    @contextlib.contextmanager
    def watching_generate(self):
        """For the span of one job's TRL call (worker/trl_seam.py): the generating model's ``generate`` is wrapped."""
        if self.why_not is not None:  # not a single model.generate call: nothing to watch
            yield
            return
        model = self._model()
        with overriding(model, "generate", functools.partial(self._generate, model, model.generate)):
            yield

    def _generate(self, model, original, *args, **kwargs):
        self.generate_calls += 1
        if self.generate_calls > 1:
            self.why_not = self.why_not or "generate was called more than once in one job"
        if self.why_not is not None:
            return original(*args, **kwargs)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(input_ids, torch.Tensor):
            self.why_not = "generate was called without input_ids"
            return original(*args, **kwargs)
        # The model whose generate runs the decoding loop (under a PEFT wrapper, the transformers model inside it).
        inner = generating_model(model)
        handle = inner.register_forward_hook(self.on_forward, with_kwargs=True)
        step = inner.__dict__.get("_compiled_call")
        if isinstance(step, CompiledDecodeStep):
            step.observer = self.on_compiled_step
        try:
            out = original(*args, **kwargs)
        finally:
            handle.remove()
            if isinstance(step, CompiledDecodeStep):
                step.observer = None
        self.finish(out, input_ids.size(1))
        return out

    def on_forward(self, _module, args, kwargs, output):
        """One forward pass inside generate (a forward hook's signature): the prefill, then one per decoding step."""
        if self.why_not is not None:
            return
        with record_function("behaviour_logps"):  # (what bench/generation_bench.py --profile reports)
            self._take(args, kwargs, output)

    def _take(self, args, kwargs, output) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        logits = getattr(output, "logits", None)
        if not isinstance(input_ids, torch.Tensor) or not isinstance(logits, torch.Tensor):
            self.why_not = "a forward pass inside generate had no input_ids or no logits"
            return
        if self._pending is not None:
            # This forward's last input token is the one sampled from the previous forward's logits.
            if input_ids.size(0) != self._pending.size(0):
                self.why_not = "the decoding forwards' batch size changed"
                return
            self._gather(input_ids[:, -1])
        # A copy (in float32, as generate samples from): the output, and its large first-step logits, go away.
        self._pending = logits[:, -1, :].to(dtype=torch.float32, copy=True)

    def on_compiled_step(self, kwargs: dict, output) -> None:
        """The same, from the compiled decoding step's observer (worker/decoding/compiled.py)."""
        self.on_forward(None, (), kwargs, output)

    def _gather(self, tokens: torch.Tensor) -> None:
        tokens = tokens.to(self._pending.device)
        # What TRL's fused LM head computes, in float32 (trl's selective_log_softmax is the same sum, ~4x slower
        # per decoding step on small batches: it checks for its Triton kernel and loops over rows).
        logps = torch.log_softmax(self._pending / self.temperature, dim=-1).gather(1, tokens[:, None])[:, 0]
        self._step_logps.append(logps)
        self._step_tokens.append(tokens)
        self._pending = None

    def finish(self, out, prompt_length: int) -> None:
        """generate returned ``out`` (prompt and new tokens): the last token's log-prob, then every token checked
        against what the forwards saw."""
        if self.why_not is not None:
            return
        if not isinstance(out, torch.Tensor):
            self.why_not = "generate did not return a tensor of token ids"
            return
        new_tokens = out[:, prompt_length:]
        steps = len(self._step_logps) + (self._pending is not None)
        if steps != new_tokens.size(1) or self._pending is None or self._pending.size(0) != out.size(0):
            # e.g. chunked prefill, assisted decoding, deferred stop checks, or rows other than the output's
            self.why_not = "generate's forward passes do not match the generated tokens one to one"
            return
        self._gather(out[:, -1])
        tokens = torch.stack(self._step_tokens, dim=1)
        if not torch.equal(tokens, new_tokens.to(tokens.device)):
            self.why_not = "the tokens seen by generate's forward passes are not the generated ones"
            return
        self.logps, self.tokens = torch.stack(self._step_logps, dim=1), tokens
        self._step_logps, self._step_tokens = [], []

    def _model(self) -> torch.nn.Module:
        # The model TRL's transformers path generates with (unwrap_model_for_generation's).
        return self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)

    def given(self, tokens: torch.Tensor, logps: torch.Tensor) -> None:
        """The log-probs of one generate call that decoded them itself (worker/decoding/graph.py), with its tokens."""
        self.generate_calls, self.tokens, self.logps = 1, tokens, logps

    # ------------------------------------------------------------------ after scoring

    def rows(self, start: int, stop: int) -> BehaviourCapture:
        """What was captured for rows ``start:stop`` of the generate call: one job's share of a call that
        generated several jobs' rows (worker/generate.py generate_jobs)."""
        part = BehaviourCapture.__new__(BehaviourCapture)
        part.__dict__.update(self.__dict__)
        if self.logps is not None:
            part.logps, part.tokens = self.logps[start:stop], self.tokens[start:stop]
        return part

    def per_token_logps(self, batch: dict) -> torch.Tensor | None:
        """The captured log-probs shaped as TRL's ``old_per_token_logps`` for ``batch``, or None (see why_not)."""
        if self.why_not is None and self.generate_calls == 0:
            self.why_not = "generate was not called"
        if self.why_not is not None:
            return None
        completion_ids, mask = batch["completion_ids"], batch["completion_mask"].bool()
        if completion_ids.size(0) != self.logps.size(0):
            self.why_not = "TRL's batch does not have one row per generated sequence"
            return None
        # TRL cuts each completion after its EOS and right-pads to the longest (or to pad_to_multiple_of).
        width, captured = completion_ids.size(1), self.logps.size(1)
        logps = self.logps.to(completion_ids.device)[:, :width]
        tokens = self.tokens.to(completion_ids.device)[:, :width]
        if width > captured:  # padding only: beyond every completion, so masked out
            logps = torch.nn.functional.pad(logps, (0, width - captured))
            tokens = torch.nn.functional.pad(tokens, (0, width - captured))
        # TRL keeps the generate call's row order; were that to change, this would notice.
        if not bool(((tokens == completion_ids) | ~mask).all()):
            self.why_not = "TRL's completions are not the generated rows in order"
            return None
        # Masked-out positions as TRL's forward pass gives them: 0.
        return torch.where(mask, logps, torch.zeros_like(logps))


    def row_lists(self, completion_ids: list[list[int]]) -> list[list[float]] | None:
        """The captured log-probs of one generate call as TRL's ``_generate_single_turn`` returns a turn's
        log-probs: one list per row, as long as the row's completion (cut after its EOS); None (see why_not)
        when the tokens do not match."""
        if self.why_not is None and self.generate_calls == 0:
            self.why_not = "generate was not called"
        if self.why_not is not None:
            return None
        if len(completion_ids) != self.logps.size(0):
            self.why_not = "a turn's completions are not one per generated row"
            return None
        logps, tokens = self.logps.float().cpu(), self.tokens.cpu()
        lists = []
        for row, ids in enumerate(completion_ids):
            if len(ids) > tokens.size(1) or tokens[row, :len(ids)].tolist() != list(ids):
                self.why_not = "a turn's completions are not the generated rows in order"
                return None
            lists.append(logps[row, :len(ids)].tolist())
        return lists


class MultiTurnCapture:
    """Behaviour log-probs across the turns of TRL's tool loop, for model-generated tokens only.

    Each turn is one ``_generate_single_turn`` call, one ``model.generate`` over the rows still calling tools.
    Each call is watched by its own BehaviourCapture and returns its log-probs the way vLLM's path does (one
    list per row); TRL's loop then assembles them across turns exactly as it assembles the completion ids: 0.0
    on the tool-result tokens (``tool_mask`` 0), cut where it cuts a turn to ``max_completion_length``. The
    assembled lists are taken out of ``_generate``'s output (``received``) before TRL would read them as
    vLLM's sampling log-probs. Should any turn not be captured, every turn still returns lists of the right
    length (TRL's loop extends them), ``why_not`` says why, and the caller falls back to a forward pass.
    """

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer
        self.why_not: str | None = not_captured(trainer)
        self.turns = 0
        self.completion_ids: list[list[int]] | None = None
        self.logps: list[list[float]] | None = None

    def capturing(self, generate_single_turn):
        """TRL's ``_generate_single_turn``, each call (a turn) watched by a BehaviourCapture of its own."""
        if self.why_not is not None:
            return generate_single_turn

        def capturing(prompt_ids, *args, **kwargs):
            turn = BehaviourCapture(self.trainer)
            with turn.watching_generate():
                completion_ids, logprobs = generate_single_turn(prompt_ids, *args, **kwargs)
            self.turns += 1
            lists = turn.row_lists(completion_ids)
            if lists is None:
                self.why_not = self.why_not or f"turn {self.turns}: {turn.why_not}"
                lists = [[0.0] * len(ids) for ids in completion_ids]
            return completion_ids, lists

        return capturing

    def received(self, generated: tuple) -> tuple:
        """TRL's ``_generate`` output with the assembled log-probs taken out (kept here)."""
        if self.why_not is None:
            self.completion_ids, self.logps = generated[1], generated[4]
        return generated[:4] + (None,) + generated[5:]

    def per_token_logps(self, batch: dict) -> torch.Tensor | None:
        """The assembled log-probs shaped as TRL's ``old_per_token_logps`` for ``batch``, or None (see why_not)."""
        if self.why_not is None and self.logps is None:
            self.why_not = "generate was not called"
        if self.why_not is not None:
            return None
        completion_ids, mask = batch["completion_ids"], batch["completion_mask"].bool()
        if len(self.logps) != completion_ids.size(0) or any(
                len(lp) != len(ids) for lp, ids in zip(self.logps, self.completion_ids, strict=True)):
            self.why_not = "the log-probs assembled across turns do not fit TRL's completions"
            return None
        out = torch.zeros(completion_ids.shape, dtype=torch.float32)
        for row, (lp, ids) in enumerate(zip(self.logps, self.completion_ids, strict=True)):
            if completion_ids[row, :len(ids)].tolist() != list(ids):
                self.why_not = "TRL's completions are not the generated rows in order"
                return None
            out[row, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        out = out.to(completion_ids.device)
        return torch.where(mask, out, torch.zeros_like(out))


def not_captured(trainer: GRPOTrainer) -> str | None:
    """Why this trainer's generate calls are not watched, or None. In synchronous mode nothing is captured: the
    PS's weights are the behaviour weights, and no behaviour log-probs are sent (worker/generate.py)."""
    if getattr(trainer.args, "max_staleness", None) == 0:
        return "synchronous mode"
    return BehaviourCapture.unsupported(trainer)


def capture_for(trainer: GRPOTrainer) -> BehaviourCapture | MultiTurnCapture:
    """The capture that follows how this trainer generates: one generate call, or one per turn (tools)."""
    return MultiTurnCapture(trainer) if trainer.tools else BehaviourCapture(trainer)
