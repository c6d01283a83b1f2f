"""Groups (ps/groups.py): each group's reward spread as TRL measures it, and batches assembled from groups of
several results that a model scores as it scores the results they came from."""

import pytest
import torch
from trl.trainer.utils import nanstd

from asyncgrpo.tasks.demo import build_model, build_tokenizer
from ps.groups import assemble, group_reward_std, slice_logs

G = 2
PAD = 0


def result_batch(prompts: list[list[int]], completions: list[list[int]], seed: int) -> dict:
    """A worker's batch as TRL pads it: prompts on the left, completions on the right, masks 1 on tokens."""
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    generator = torch.Generator().manual_seed(seed)
    batch = {
        "prompt_ids": torch.tensor([[PAD] * (width_p - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [PAD] * (width_c - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions]),
        "advantages": torch.randn(len(prompts), generator=generator),
    }
    batch["old_per_token_logps"] = -torch.rand(batch["completion_ids"].shape, generator=generator)
    batch["old_per_token_logps"] *= batch["completion_mask"]
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    return batch


# Two results of two groups each (G = 2), of different prompt and completion widths.
FIRST = result_batch([[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]], [[10, 11], [12], [13, 14, 15], [8]], seed=0)
SECOND = result_batch([[9], [9], [4, 5, 6, 7], [4, 5, 6, 7]], [[11, 12, 13, 14, 15], [3], [4, 4], [5]], seed=1)


def test_each_groups_reward_spread_is_trls_nanstd_over_its_completions():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, float("nan"), float("nan"), 0.25, 0.3, 0.7])
    spread = group_reward_std(rewards, 2)
    expected = [nanstd(group) if (~torch.isnan(group)).sum() > 1 else torch.tensor(0.0)
                for group in rewards.view(-1, 2)]
    assert torch.allclose(spread, torch.stack(expected).float())
    assert spread[0] == 0 and spread[2] == 0 and spread[1] > 0  # alike; one scored; spread


def test_a_batch_taking_every_group_of_one_result_is_that_result():
    assembled = assemble([(FIRST, [0, 1])], G, PAD)
    assert assembled.keys() == FIRST.keys() and all(torch.equal(assembled[k], FIRST[k]) for k in FIRST)


def test_groups_of_two_results_keep_their_rows_padded_as_trl_pads():
    batch = assemble([(FIRST, [1]), (SECOND, [0, 1])], G, PAD)
    # FIRST's group 1 (rows 2, 3), then SECOND's rows 0-3; prompts padded on the left to 4, completions on the
    # right to 5, with masks 0 and behaviour log-probs 0 on the padding.
    assert batch["prompt_ids"].tolist() == [[0, 7, 8, 9], [0, 7, 8, 9], [0, 0, 0, 9], [0, 0, 0, 9],
                                            [4, 5, 6, 7], [4, 5, 6, 7]]
    assert batch["prompt_mask"].tolist()[0] == [0, 1, 1, 1] and batch["prompt_mask"].tolist()[2] == [0, 0, 0, 1]
    assert batch["completion_ids"].tolist() == [[13, 14, 15, 0, 0], [8, 0, 0, 0, 0], [11, 12, 13, 14, 15],
                                                [3, 0, 0, 0, 0], [4, 4, 0, 0, 0], [5, 0, 0, 0, 0]]
    assert batch["completion_mask"].sum(dim=1).tolist() == [3, 1, 5, 1, 2, 1]
    assert torch.equal(batch["advantages"], torch.cat([FIRST["advantages"][2:], SECOND["advantages"]]))
    assert torch.equal(batch["old_per_token_logps"][0, :3], FIRST["old_per_token_logps"][2])
    assert batch["old_per_token_logps"][0, 3:].abs().sum() == 0
    assert batch["num_items_in_batch"] == 3 + 1 + 5 + 1 + 2 + 1  # TRL's count: completion tokens in the loss


def test_tool_tokens_are_left_out_of_the_assembled_count_as_trl_leaves_them_out():
    with_tools = [dict(b, tool_mask=b["completion_mask"].clone()) for b in (FIRST, SECOND)]
    with_tools[1]["tool_mask"][0, 1:4] = 0  # three tool-result tokens in SECOND's row 0
    batch = assemble([(with_tools[0], [0]), (with_tools[1], [0])], G, PAD)
    assert batch["num_items_in_batch"] == (2 + 1) + (5 - 3 + 1)


def test_a_batch_with_keys_it_cannot_split_by_group_is_refused_by_name():
    with pytest.raises(ValueError, match="pixel_values"):
        assemble([(dict(FIRST, pixel_values=torch.zeros(4, 3)), [0]), (SECOND, [1])], G, PAD)


def completion_logps(model, batch: dict) -> list[torch.Tensor]:
    """Each row's log-probs of its completion tokens (unpadded), from one forward pass over the batch as TRL's
    loss runs it (prompt and completion, their masks as the attention mask)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -batch["completion_ids"].size(1) - 1:-1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return [row[m.bool()] for row, m in zip(logps, batch["completion_mask"], strict=True)]


def test_the_model_scores_each_assembled_row_as_in_the_result_it_came_from():
    """Re-padding changes where a row's tokens sit, not what the model gives them (masked padding, relative
    positions): the PS's loss sees each group as its worker's batch did."""
    model = build_model(seed=0, tokenizer=build_tokenizer()).eval()
    alone = completion_logps(model, FIRST)[2:] + completion_logps(model, SECOND)
    together = completion_logps(model, assemble([(FIRST, [1]), (SECOND, [0, 1])], G, PAD))
    assert len(alone) == len(together) == 6
    for a, b in zip(alone, together, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a, b)


def test_the_completions_table_keeps_the_rows_of_the_groups_taken():
    logs = {"prompt": ["a", "a", "b", "b"], "completion": ["1", "2", "3", "4"], "rewards": {"f": [0, 1, 2, 3]},
            "advantages": [0.1, 0.2, 0.3, 0.4], "extra": {"x": [5, 6, 7, 8]}}
    assert slice_logs(logs, [2, 3]) == {"prompt": ["b", "b"], "completion": ["3", "4"], "rewards": {"f": [2, 3]},
                                        "advantages": [0.3, 0.4], "extra": {"x": [7, 8]}}
