"""The compiled forward transformers' ``generate`` calls at each decoding step (``--worker_decoding compiled``), with
an observer behaviour capture sets (worker/behaviour.py: a forward hook would be traced into the graph), and what
the compiled decoders and behaviour capture share about the model they decode with."""

from __future__ import annotations

import torch
from transformers import CompileConfig

COMPILED_CALL = "_compiled_call"  # what transformers' get_compiled_call returns when it is set (with the config below)
LAST_COMPILE_CONFIG = "_last_compile_config"


def generating_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose generate runs the decoding loop: a PEFT model's base model (with the adapter
    layers in it), else the model itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class CompiledDecodeStep:
    """The compiled forward generate calls for each decoding step, with an observer called after each call."""

    def __init__(self, model: torch.nn.Module, compile_config: CompileConfig):
        self.compiled = torch.compile(model.forward, **compile_config.to_dict())
        self.observer = None  # callable(kwargs, output), set by BehaviourCapture for the span of a generate call

    def __call__(self, *args, **kwargs):
        output = self.compiled(*args, **kwargs)
        if self.observer is not None:
            self.observer(kwargs, output)
        return output
