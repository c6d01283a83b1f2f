"""What the built-in tasks (demo.py, lookup.py) build their model from, offline: a character-level tokenizer made
with the `tokenizers` library, a tiny Llama over it (deterministic given a seed), and the folder both are saved to
for `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`. A Llama config, because with a
Qwen2 config `AutoTokenizer` swaps a custom tokenizer for its own."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"


def character_tokenizer(vocab: Sequence[str], special: Sequence[str] = (), whole: Sequence[str] = (),
                        **kwargs) -> PreTrainedTokenizerFast:
    """A tokenizer over ``vocab`` (ids in its order) that splits text into single characters, except the
    ``special`` and ``whole`` tokens (added as special and as plain tokens), matched whole; decoding joins tokens
    without spaces, padding is on the left (as TRL pads prompts). ``kwargs`` go to PreTrainedTokenizerFast."""
    backend = Tokenizer(WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # join tokens as they are, no spaces
    if special:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if whole:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in whole])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, padding_side="left", clean_up_tokenization_spaces=False, **kwargs)


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int, hidden_size: int, num_layers: int, num_heads: int,
                intermediate_size: int, max_positions: int) -> LlamaForCausalLM:
    """A tiny Llama over ``tokenizer`` (tied embeddings), its weights drawn from ``seed``."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    # Seeds the CPU generator only for the construction, and puts the caller's RNG state back afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def save(path: str | os.PathLike, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> str:
    """Saves ``model`` (safetensors) and ``tokenizer`` to folder ``path``; returns it."""
    path = os.fspath(path)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
