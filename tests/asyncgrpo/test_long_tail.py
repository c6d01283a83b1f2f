"""The long-tail workload's model (asyncgrpo/tasks/long_tail.py): every step ends a row with the stated
probability, whatever the prompt, the tokens before, the depth and the dtype; lengths come out geometric."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncgrpo.tasks.long_tail import end_with_probability, geometric_mean_length

EOS = 2


def model(layers: int, hidden: int, vocab: int, dtype=torch.float32, tied: bool = False,
          mlp: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=mlp or 3 * hidden, vocab_size=vocab, tie_word_embeddings=tied,
                         max_position_embeddings=512, eos_token_id=EOS, pad_token_id=0)
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize(("layers", "hidden", "mlp", "vocab", "dtype"), [(2, 64, None, 16, torch.float32),
                                                                         (24, 512, 512, 2000, torch.bfloat16)])
def test_every_step_ends_a_row_with_the_stated_probability(layers, hidden, mlp, vocab, dtype):
    """Deep and wide, in bf16: what the layers add must not drown the constant coordinate (with a constant 1e3 times
    an embedding coordinate, rows of this shape ended half as often as asked, and at Qwen2.5-0.5B's 200 times
    less often)."""
    m = model(layers, hidden, vocab, dtype, mlp=mlp)
    end_with_probability(m, EOS, 1 / 128)
    ids = torch.randint(3, vocab, (4, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p_end = m(ids).logits.float().softmax(-1)[:, :, EOS]
    assert p_end.min() > 0.8 / 128 and p_end.max() < 1.2 / 128


def test_sampled_lengths_are_geometric_with_the_stated_mean():
    m = model(2, 64, 16)
    end_with_probability(m, EOS, 1 / 16)
    torch.manual_seed(1)
    with torch.no_grad():
        out = m.generate(torch.randint(3, 16, (400, 4)), max_new_tokens=64, do_sample=True, top_k=0, pad_token_id=0,
                         eos_token_id=EOS)[:, 4:]
    lengths = [next((i + 1 for i, t in enumerate(row) if t == EOS), len(row)) for row in out.tolist()]
    mean = sum(lengths) / len(lengths)
    assert abs(mean - geometric_mean_length(1 / 16, 64)) < 1.5  # 15.7; the mean of 400 draws within 2 sigma
    assert 0 < sum(n == 64 for n in lengths) < 20  # a few rows reach the cap (1.6% of them on average)


def test_tied_embeddings_are_refused():
    with pytest.raises(ValueError, match="tied"):
        end_with_probability(model(2, 64, 16, tied=True), EOS, 0.1)
