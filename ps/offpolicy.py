"""Off-policy correction: per-token importance weights from the behaviour policy to the current one.

A worker samples with the weights it synced (the behaviour policy); by the time the PS
trains on the result it has taken ``staleness`` more optimizer steps. TRL's loss clips the
ratio current/behaviour at 1 +- epsilon, which zeroes the gradient of every token whose
ratio left that band: once results are a few steps old, most of them. Decoupled PPO (as in
AReaL) separates the two roles: the PPO ratio is taken against a proximal policy, and the
gap between proximal and behaviour is corrected by an importance weight, truncated (or
masked) at a cap as prime-rl, verl and NeMo-RL do:

    loss_t = w_t * TRL's loss_t(ratio = pi / pi_prox),   w_t = min(pi_prox / pi_behaviour, cap)

When one result trains one optimizer step the proximal policy is the current one: TRL's
ratio is 1 in value (its clip never binds) with gradient grad log pi, and the weight is
computed from the log-probs TRL's own loss forward already produced (no extra forward
pass). A result that trains several steps (``num_iterations``, ``steps_per_generation``)
brings its proximal log-probs as TRL's ``old_per_token_logps``, computed once when it was
taken: the weight is fixed for the job and TRL's clipped ratio current/proximal acts on
its later steps, as in PPO's epochs. The weight enters TRL's loss as per-token advantages A * w_t, which every
``loss_type`` (grpo, dapo, dr_grpo, bnpo, cispo, sapo, luspo) supports unchanged; the KL
term (beta) is not weighted, as in TRL.

Modes (``--off_policy_correction``), the same as TRL's ``vllm_importance_sampling_mode``:
``token_truncate`` (w_t = min(r_t, cap)), ``token_mask`` (w_t = r_t, 0 where r_t > cap),
``sequence_truncate`` / ``sequence_mask`` (one ratio per completion, the product of its
tokens' ratios), and ``none`` (the behaviour log-probs become TRL's ``old_per_token_logps``:
TRL's clipped ratio current/behaviour, no weight).

Equivalence: ``token_truncate`` with cap c and ``loss_type dapo`` has the same gradient as
TRL's ``loss_type cispo`` with ``epsilon_high c`` and the behaviour log-probs as
``old_per_token_logps`` (tests/ps/test_offpolicy.py proves it); the modes here work with every
loss type.
"""

from __future__ import annotations

import contextlib

import torch


def importance_weights(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float) -> torch.Tensor:
    """Weights (B, T) for token modes, (B, 1) for sequence modes; 0 on masked-out tokens' log-ratio."""
    log_ratio = torch.where(mask.bool(), proximal - behaviour, torch.zeros_like(proximal))
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    return ratio.masked_fill(ratio > cap, 0.0)


class TokenWeighting:
    """Applies the correction inside TRL's ``_compute_loss``.

    ``armed(inputs)`` hands TRL per-token advantages to be filled in; the trainer's
    ``_get_per_token_logps_and_entropies`` calls ``on_policy_logps`` with the log-probs of
    TRL's loss forward, which fills them before TRL's loss reads them, unless the inputs
    carry the proximal log-probs (``old_per_token_logps``): then they are filled at once."""

    def __init__(self, mode: str, cap: float):
        self.mode, self.cap = mode, cap
        self._pending = None
        self._metrics: dict[str, float] = {}

    @property
    def input_key(self) -> str:
        """Where the behaviour log-probs go in TRL's inputs."""
        return "old_per_token_logps" if self.mode == "none" else "sampling_per_token_logps"

    @contextlib.contextmanager
    def armed(self, inputs: dict):
        behaviour = inputs.get("sampling_per_token_logps")
        if self.mode == "none" or behaviour is None:  # no behaviour log-probs: generated with these very weights
            yield inputs
            return
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        per_token = advantages.unsqueeze(1).repeat(1, mask.size(1))  # filled by on_policy_logps
        self._pending = (per_token, advantages, behaviour, mask)
        if inputs.get("old_per_token_logps") is not None:  # the job trains several steps: its proximal policy
            self.on_policy_logps(inputs["old_per_token_logps"])
        try:
            yield {**inputs, "advantages": per_token}
        finally:
            self._pending = None

    def on_policy_logps(self, logps: torch.Tensor) -> None:
        if self._pending is None:
            return
        per_token, advantages, behaviour, mask = self._pending
        self._pending = None  # only the loss forward of the policy, not any later one
        with torch.no_grad():
            weights = importance_weights(logps.detach(), behaviour, mask, self.mode, self.cap)
            per_token.copy_(advantages.unsqueeze(1) * weights)
            ratios = importance_weights(logps.detach(), behaviour, mask, self.mode, float("inf"))
            counted = mask.bool() if weights.size(1) > 1 else mask.bool().any(-1, keepdim=True)
            if counted.any():
                self._metrics = {"off_policy/weight_mean": weights[counted].mean().item(),
                                 "off_policy/ratio_max": ratios[counted].max().item(),
                                 "off_policy/capped_frac": (ratios[counted] > self.cap).float().mean().item()}

    def metrics(self) -> dict[str, float]:
        metrics, self._metrics = self._metrics, {}
        return metrics
