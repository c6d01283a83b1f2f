"""What a publisher shares: the whole model, or only a PEFT model's adapter.

With ``--use_peft`` the PS trains a LoRA adapter on a frozen base model. Every worker holds
the same base (loaded from the same path) and the same adapter modules (built from the same
flags), so the PS publishes only the trainable tensors and a sync copies only those: a
Qwen2.5-0.5B with an r16 all-linear adapter shares 35 MB instead of 1 GB.

That is right only while the worker's base *is* the PS's. The layout therefore carries a
fingerprint of the base: a SHA-256 over the frozen tensors' names, dtypes and shapes and a
sample of their values (SAMPLES evenly spaced elements of each, so it costs milliseconds
even for billions of parameters). A worker whose fingerprint differs is refused
(``WeightsMismatch``) instead of generating from another model.

    shared_tensors(model)       # name -> tensor, what is published and synced
    gather_full_tensors(model)  # the same, whole, from a model FSDP2 shards across ranks (every rank calls it)
    layout_of(model)            # the publisher's Layout (with the base fingerprint for an adapter)
    check_model(layout, model)  # on the worker, once per publisher: WeightsMismatch or nothing
"""

from __future__ import annotations

import hashlib
import sys
import weakref

import torch

from asyncgrpo.weights.layout import Layout, WeightsMismatch

SAMPLES = 16  # values read from each frozen tensor for the fingerprint
_adapter_params: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # PEFT model -> its trainable parameters


def is_adapter_model(model: torch.nn.Module) -> bool:
    """A PEFT model (peft.PeftModel). peft not imported yet means no model can be one."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def shared_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a sync must copy: the whole state_dict, or, for a PEFT model, its trainable parameters
    (the adapter, and any ``modules_to_save``) under their state_dict names."""
    if not is_adapter_model(model):
        return model.state_dict()
    # Walking a PEFT model's module tree costs milliseconds (2.5 ms for a 0.5B model), as much as the copy
    # itself on a GPU; the adapter's Parameter objects live as long as the model (training updates them in
    # place), so they are found once per model. Callers only read the dict.
    found = _adapter_params.get(model)
    if found is None:
        found = _adapter_params[model] = {name: p for name, p in model.named_parameters() if p.requires_grad}
    return found


def gather_full_tensors(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """For a model sharded by FSDP2 (its parameters are DTensors, one shard per rank): the shared tensors,
    whole. Each ``full_tensor()`` is an all-gather, so every rank calls this at the same point; only the
    ranks that ``keep`` hold the result (the first rank, which publishes: it needs the memory for one whole
    copy beside its shard). None for a model that is not sharded (publish it as it is)."""
    from torch.distributed.tensor import DTensor

    # Not shared_tensors' cache: fully_shard replaces a model's Parameter objects with DTensor ones.
    tensors = ({name: p for name, p in model.named_parameters() if p.requires_grad} if is_adapter_model(model)
               else model.state_dict())
    if not any(isinstance(t, DTensor) for t in tensors.values()):
        return None
    full = {}
    for name, t in tensors.items():  # one tensor at a time: the other ranks never hold the whole model
        whole = t.detach().full_tensor() if isinstance(t, DTensor) else t
        if keep:
            full[name] = whole
    return full if keep else None


def base_fingerprint(model: torch.nn.Module) -> dict:
    """The identity of the frozen tensors (all but ``shared_tensors``): sha256, count and bytes."""
    shared = shared_tensors(model)
    digest = hashlib.sha256()
    samples: dict[torch.device, list[torch.Tensor]] = {}
    count = nbytes = 0
    for name, t in model.state_dict().items():
        if name in shared or not isinstance(t, torch.Tensor):
            continue
        digest.update(f"{name}:{str(t.dtype).removeprefix('torch.')}:{list(t.shape)};".encode())
        count += 1
        nbytes += t.numel() * t.element_size()
        n = t.numel()
        if n:
            k = min(n, SAMPLES)
            # Integer positions (a float linspace may round differently on CPU and GPU).
            positions = torch.arange(k, device=t.device) * (n - 1) // max(k - 1, 1)
            samples.setdefault(t.device, []).append(t.detach().reshape(-1)[positions].to(torch.float64))
    for device in sorted(samples, key=str):  # one device-to-host copy per device
        digest.update(torch.cat(samples[device]).cpu().numpy().tobytes())
    return {"sha256": digest.hexdigest(), "tensors": count, "bytes": nbytes}


def layout_of(model: torch.nn.Module) -> Layout:
    return Layout.of(shared_tensors(model), base=base_fingerprint(model) if is_adapter_model(model) else None)


def check_model(layout: Layout, model: torch.nn.Module) -> None:
    """Raises WeightsMismatch, with one line saying why, when ``model`` cannot take what ``layout`` publishes
    as an adapter or as a whole model (shapes and names are checked by ``Layout.destinations``)."""
    adapter = is_adapter_model(model)
    if layout.base is not None and not adapter:
        raise WeightsMismatch("the parameter server publishes a LoRA adapter and this worker's model has none: "
                              "start the worker with the same --use_peft / --lora_* flags as the parameter server")
    if layout.base is None and adapter:
        raise WeightsMismatch("the parameter server publishes a whole model and this worker's model has a LoRA "
                              "adapter: start the worker with the same flags as the parameter server (no --use_peft)")
    if layout.base is None:
        return
    mine = base_fingerprint(model)
    if mine["sha256"] != layout.base["sha256"]:
        raise WeightsMismatch(
            f"this worker's base model is not the parameter server's (fingerprint {mine['sha256'][:12]}, "
            f"{mine['tensors']} tensors, {mine['bytes']} bytes; the parameter server's {layout.base['sha256'][:12]}, "
            f"{layout.base.get('tensors')} tensors, {layout.base.get('bytes')} bytes): its adapter would generate "
            "from another model; start the worker with the parameter server's --model_name_or_path and dtype")
