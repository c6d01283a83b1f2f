"""q/k/v and gate/up as one GEMM each (worker/decoding/fused_projections.py): the same model, the same tokens, and
weight syncs that still land in place, against an unfused copy of the same model."""

from __future__ import annotations

import copy
from contextlib import closing

import pytest
import torch
from helpers.decoding import GREEDY, SAMPLING, decoded, prompt_ids, trainer_for
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from asyncgrpo.run import RunDir
from asyncgrpo.tasks.demo import build_tokenizer
from asyncgrpo.weights import make_publisher, make_subscriber
from worker.decoding.fused_projections import fuse_projections
from worker.decoding.graph import GraphDecoding

pytestmark = pytest.mark.filterwarnings("ignore")

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             max_position_embeddings=256, initializer_range=0.3)
ARCHITECTURES = {  # grouped-query attention in each; biases (Llama's and Qwen2's), q/k norms (Qwen3), windows
    "llama": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 4}),
}


def model_of(arch: str, seed: int = 0):
    tok = build_tokenizer()
    config_class, model_class, extra = ARCHITECTURES[arch]
    config = config_class(**SMALL, **extra, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return model_class(config).eval()


def greedy(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_fused_model_computes_what_the_unfused_one_does(arch):
    model = model_of(arch)
    reference = copy.deepcopy(model)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    assert fuse_projections(model) is None
    assert all(hasattr(layer.self_attn, "qkv") and hasattr(layer.mlp, "gate_up") for layer in model.model.layers)
    assert {name: t.shape for name, t in model.state_dict().items()} == shapes  # the PS sees the same model
    ids = torch.randint(3, 16, (3, 12), generator=torch.Generator().manual_seed(0))  # longer than the window
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    assert torch.equal(greedy(model, ids), greedy(reference, ids))


def test_the_projections_parameters_are_views_into_the_fused_buffer():
    """What a weight sync writes into a projection's parameter (its state_dict tensor, in place) is what the fused
    GEMM reads: no second copy of the weights."""
    model = model_of("qwen2")
    fuse_projections(model)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    state = model.state_dict()
    q, k = attn.q_proj.out_features, attn.k_proj.out_features
    state["model.layers.1.self_attn.v_proj.weight"].fill_(0.25)
    state["model.layers.1.self_attn.k_proj.bias"].fill_(-1.0)
    state["model.layers.1.mlp.up_proj.weight"].fill_(0.5)
    assert attn.qkv.weight[q + k:].eq(0.25).all() and not attn.qkv.weight[:q + k].eq(0.25).any()
    assert attn.qkv.bias[q:q + k].eq(-1.0).all()
    assert mlp.gate_up.weight[mlp.gate_proj.out_features:].eq(0.5).all()


def test_a_weight_sync_into_a_fused_model_decodes_as_the_new_weights_do(tmp_path):
    model, new_weights = model_of("llama", seed=0), model_of("llama", seed=1)
    fuse_projections(model)
    addresses = [p.data_ptr() for p in model.parameters()]
    run = RunDir.create(tmp_path / "run")
    with closing(make_publisher(run, new_weights, "mmap")) as publisher, closing(make_subscriber(run)) as sub:
        publisher.publish(version=1, step=1)
        assert sub.sync(model) == 1
    assert [p.data_ptr() for p in model.parameters()] == addresses
    ids = torch.randint(3, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(greedy(model, ids), greedy(new_weights, ids))


def test_the_decoding_step_fuses_and_decodes_the_tokens_of_an_unfused_generate(tmp_path):
    """Qwen2.5's layout (grouped-query attention, q/k/v biases) through the worker's step, against transformers'
    generate on an unfused copy of the model."""
    model = model_of("qwen2")
    reference = trainer_for(tmp_path / "reference", copy.deepcopy(model), **GREEDY)
    trainer = trainer_for(tmp_path / "fused", model, **GREEDY)
    ids = prompt_ids(trainer)
    decoding = GraphDecoding(trainer, 1, ids, compile=False)
    assert decoding.unfused is None and hasattr(model.model.layers[0].self_attn, "qkv")
    with torch.no_grad():
        expected = reference._generate_single_turn(ids, None, {}, reference.num_generations)[0]
    assert decoded(decoding, ids) == expected


def test_qwen2_layers_read_only_the_written_columns_as_they_read_the_whole_cache(tmp_path):
    """Qwen2.5's layout, fused, through the step that reads the cache's written prefix in buckets of columns: the same
    tokens and behaviour log-probs as the step that reads the whole cache, over a completion through every bucket
    (run eagerly here; compiled, with Llama layers: test_decode_step.py)."""
    trainer = trainer_for(tmp_path, model_of("qwen2"), **{**SAMPLING, "max_completion_length": 64})
    ids = prompt_ids(trainer)
    results = []
    for buckets in (1, 4):
        decoding = GraphDecoding(trainer, 1, ids, compile=False, attention_buckets=buckets)
        assert decoding.unfused is None and len(decoding.buckets) == buckets
        torch.manual_seed(0)
        with torch.no_grad():
            results.append(decoding.decode_batch(decoding.pad_batch(ids)))
    (expected, tokens, logps), (completions, bucketed_tokens, bucketed_logps) = results
    assert completions == expected and max(len(c) for c in completions) == 64
    assert torch.equal(bucketed_tokens, tokens) and torch.equal(bucketed_logps, logps)


def test_layers_that_are_not_plain_linears_are_left_alone_and_the_reason_given():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model_of("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    base = model.get_base_model()
    before = {name: t.data_ptr() for name, t in base.state_dict().items()}
    why = fuse_projections(base)
    assert why is not None and "nn.Linear" in why
    assert not hasattr(base.model.layers[0].self_attn, "qkv")
    assert {name: t.data_ptr() for name, t in base.state_dict().items()} == before
