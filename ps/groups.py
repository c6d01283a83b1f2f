"""Groups: a result's rows by prompt, the unit dynamic sampling drops and a training batch is assembled from.

A result holds ``rows / num_generations`` groups, group ``g`` being rows ``g*G .. g*G+G-1``
(one prompt's completions, as TRL's RepeatSampler lays them out). With ``--dynamic_sampling``
a group whose rewards spread no more than ``--dynamic_sampling_max_std`` (all right, or all
wrong: zero advantage everywhere) teaches nothing and is dropped; a generation batch is
assembled from the next informative groups of one or more results (ps/pipeline.py).

    spread = group_reward_std(rewards, G)                  # one value per group
    batch = assemble([(result_batch, [0, 2]), (other_batch, [1])], G, pad_token_id)
    logs = slice_logs(result_logs, rows)                   # TRL's completions-table rows of those rows
    logs = merge_logs([logs, other_logs])                  # one table from several results' rows

Assembling concatenates the groups' rows and pads every part to the widest (prompts on the
left, completions on the right, as TRL pads them) with masks 0: a row's tokens, masks,
behaviour and reference log-probs are its own, and ``num_items_in_batch`` is counted again
over the rows taken, as TRL counts it (completion tokens under the loss mask).
"""

from __future__ import annotations

import torch

LEFT_PADDED = ("prompt_ids", "prompt_mask")
RIGHT_PADDED = ("completion_ids", "completion_mask", "old_per_token_logps", "sampling_per_token_logps",
                "ref_per_token_logps", "tool_mask")
PER_ROW = ("advantages", "importance_sampling_ratio")
IDS = ("prompt_ids", "completion_ids")  # padded with the tokenizer's pad token; masks and log-probs with 0


def group_reward_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Each group's reward standard deviation, unbiased and ignoring NaN (unscored completions) as TRL's nanstd;
    0 for a group with fewer than two scored completions."""
    grouped = rewards.float().view(-1, num_generations)
    scored = ~torch.isnan(grouped)
    count = scored.sum(dim=1)
    mean = torch.where(scored, grouped, 0.0).sum(dim=1) / count.clamp(min=1)
    squares = torch.where(scored, (grouped - mean.unsqueeze(1)) ** 2, 0.0).sum(dim=1)
    return torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(mean))


def group_rows(groups: list[int], num_generations: int) -> list[int]:
    return [g * num_generations + i for g in groups for i in range(num_generations)]


def assemble(parts: list[tuple[dict, list[int]]], num_generations: int, pad_token_id: int) -> dict:
    """One batch from ``(batch, group indices)`` parts. A single part taking every group of its batch is that
    batch, unchanged."""
    first, groups = parts[0]
    if len(parts) == 1 and len(groups) * num_generations == first["advantages"].size(0):
        return dict(first)
    unknown = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() > 0
               and k not in LEFT_PADDED + RIGHT_PADDED + PER_ROW]
    if unknown:
        raise ValueError(f"dynamic sampling assembles text batches; the results carry {unknown}, which it cannot "
                         "split by group")
    keys = [k for k in LEFT_PADDED + RIGHT_PADDED + PER_ROW if k in first]
    missing = {k for batch, _ in parts for k in keys if k not in batch}
    if missing:
        raise ValueError(f"results to be trained together differ in keys: {sorted(missing)} missing in some")
    rows = [torch.tensor(group_rows(g, num_generations), dtype=torch.long) for _, g in parts]
    out = {}
    for key in keys:
        pieces = [batch[key].index_select(0, index) for (batch, _), index in zip(parts, rows, strict=True)]
        if key in PER_ROW:
            out[key] = torch.cat(pieces)
            continue
        width = max(p.size(1) for p in pieces)
        value = pad_token_id if key in IDS else 0
        side = "left" if key in LEFT_PADDED else "right"
        out[key] = torch.cat([_pad(p, width, value, side) for p in pieces])
    loss_mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
    out["num_items_in_batch"] = loss_mask.sum()
    return out


def _pad(tensor: torch.Tensor, width: int, value, side: str) -> torch.Tensor:
    missing = width - tensor.size(1)
    if missing == 0:
        return tensor
    fill = torch.full((tensor.size(0), missing), value, dtype=tensor.dtype)
    return torch.cat([fill, tensor] if side == "left" else [tensor, fill], dim=1)


def slice_logs(logs: dict | None, rows: list[int]) -> dict | None:
    """TRL's completions-table rows (worker/generate.py completion_logs) of ``rows`` only."""
    if not logs:
        return logs

    def pick(values):
        return [values[i] for i in rows if i < len(values)]

    return {"prompt": pick(logs.get("prompt", [])), "completion": pick(logs.get("completion", [])),
            "rewards": {name: pick(v) for name, v in logs.get("rewards", {}).items()},
            "advantages": pick(logs.get("advantages", [])),
            "extra": {name: pick(v) for name, v in logs.get("extra", {}).items()}}


def merge_logs(parts: list[dict | None]) -> dict | None:
    """One completions table from several results' rows, in order (None when no part carries any)."""
    present = [part for part in parts if part]
    if len(present) <= 1:
        return present[0] if present else None
    merged = {"prompt": [], "completion": [], "rewards": {}, "advantages": [], "extra": {}}
    for part in present:
        for key in ("prompt", "completion", "advantages"):
            merged[key] += part.get(key, [])
        for key in ("rewards", "extra"):
            for name, values in part.get(key, {}).items():
                merged[key].setdefault(name, []).extend(values)
    return merged
