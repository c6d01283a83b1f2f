"""TRL's PEFT (LoRA) and QLoRA flags, with TRL's names, defaults and meanings.

TRL keeps them in ``trl.ModelConfig``, which cannot be parsed beside AsyncGRPOConfig (both
define ``model_name_or_path``). Here they are a dataclass of their own that
AsyncGRPOConfig inherits, so ``--use_peft --lora_r 16`` work on the command line and in
``--config`` YAML, the PS and the workers get the same ones, and TRL's
``get_peft_config`` / ``get_quantization_config`` read them as they read a ModelConfig.

    cfg.peft_config()         # a peft.LoraConfig, or None without --use_peft
    cfg.quantization_kwargs() # from_pretrained kwargs: the bitsandbytes config with --load_in_4bit/8bit
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass, field


@dataclass
class PeftArgs:
    # Help texts are TRL's (trl/trainer/model_config.py, trl 1.16).
    use_peft: bool = field(default=False, metadata={"help": "Whether to use PEFT for training."})
    lora_r: int = field(default=16, metadata={"help": "LoRA R value."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "LoRA target modules."})
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "List of target parameters for LoRA."})
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Model layers to unfreeze & train."})
    lora_task_type: str = field(
        default="CAUSAL_LM", metadata={"help": "Task type to pass for LoRA (use 'SEQ_CLS' for reward modeling)."})
    use_rslora: bool = field(default=False, metadata={
        "help": "Whether to use Rank-Stabilized LoRA, which sets the adapter scaling factor to `lora_alpha/√r`, "
                "instead of the original default value of `lora_alpha/r`."})
    use_dora: bool = field(default=False, metadata={
        "help": "Enable Weight-Decomposed Low-Rank Adaptation (DoRA). This technique decomposes the updates of "
                "the weights into two parts, magnitude and direction. Direction is handled by normal LoRA, whereas "
                "the magnitude is handled by a separate learnable parameter. This can improve the performance of "
                "LoRA, especially at low ranks. Right now, DoRA only supports linear and Conv2D layers. DoRA "
                "introduces a bigger overhead than pure LoRA, so it is recommended to merge weights for inference."})
    load_in_8bit: bool = field(default=False, metadata={
        "help": "Whether to use 8 bit precision for the base model. Works only with LoRA."})
    load_in_4bit: bool = field(default=False, metadata={
        "help": "Whether to use 4 bit precision for the base model. Works only with LoRA."})
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "Quantization type.", "choices": ["fp4", "nf4"]})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Whether to use nested quantization."})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "Quantization storage dtype"})

    def lora_targets_missing(self, model, err: BaseException) -> str | None:
        """One line for ConfigError when ``err`` is peft finding none of --lora_target_modules in ``model`` (as TRL
        wraps it), naming the model's linear layers; None for any other error."""
        from peft import NoMatchingPeftModuleError
        from torch import nn

        if not self.use_peft or not isinstance(err, NoMatchingPeftModuleError):
            return None
        targets = [self.lora_target_modules] if isinstance(self.lora_target_modules, str) else self.lora_target_modules
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, nn.Linear)})
        return (f"--lora_target_modules {' '.join(targets or [])}: no module of the model has that name (its linear "
                f"layers: {', '.join(linear)}; or all-linear)")

    def peft_args_problem(self, device_type: str, mixed_precision: bool = True) -> str | None:
        """What is wrong with these flags, as one line for ConfigError, or None (``mixed_precision``: the run
        computes under bf16 or fp16 autocast, TRL's default on a GPU). Also normalises
        ``lora_target_modules`` as TRL's ModelConfig does (one value, e.g. all-linear, is a string)."""
        if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]
        if self.use_peft and self.lora_r < 1:
            return f"--lora_r {self.lora_r}: must be >= 1"
        if self.use_peft and not 0 <= self.lora_dropout < 1:
            return f"--lora_dropout {self.lora_dropout}: must be in [0, 1)"
        targets = [self.lora_target_modules] if isinstance(self.lora_target_modules, str) else self.lora_target_modules
        if self.use_peft and "lm_head" in (targets or []):
            # GRPOTrainer refuses it when built (its log-probs use lm_head.weight directly): say so before starting.
            return ("--lora_target_modules lm_head: TRL computes log-probs from lm_head.weight directly, so an adapter "
                    "there would never train; use --lora_modules_to_save lm_head to train the head itself")
        quantized = "--load_in_4bit" if self.load_in_4bit else "--load_in_8bit" if self.load_in_8bit else None
        if quantized is None:
            return None
        if self.load_in_4bit and self.load_in_8bit:
            return "--load_in_4bit and --load_in_8bit: choose one"
        if not self.use_peft:
            return f"{quantized}: a quantized base model can only train an adapter; add --use_peft"
        if device_type != "cuda":
            return f"{quantized}: bitsandbytes quantization needs a CUDA GPU, and this run is on {device_type}"
        if self.lora_modules_to_save and not mixed_precision:
            # TRL casts a quantized model's trainable modules to bfloat16; without autocast a bfloat16 head meets
            # float32 hidden states and every generation fails (TRL's own generation too).
            return (f"{quantized} with --lora_modules_to_save needs --bf16 or --fp16 (TRL trains those modules in "
                    "bfloat16 on a quantized base; without mixed precision every generation fails)")
        if importlib.util.find_spec("bitsandbytes") is None:
            return f"{quantized} needs the bitsandbytes package, which is not installed (pip install bitsandbytes)"
        return None

    def peft_config(self):
        """TRL's LoraConfig for these flags (``trl.get_peft_config``), or None without --use_peft."""
        from trl import get_peft_config

        return get_peft_config(self)

    def quantization_kwargs(self) -> dict:
        """Extra ``from_pretrained`` kwargs: the base model quantized with bitsandbytes (QLoRA), by TRL's
        ``get_quantization_config`` (computing in ``--dtype``, as TRL does), placed on this process's GPU;
        {} without --load_in_4bit / --load_in_8bit."""
        if not (self.load_in_4bit or self.load_in_8bit):
            return {}
        import torch
        from trl import get_quantization_config

        args = self
        if getattr(self, "dtype", None) == "auto":  # no compute dtype of that name: bitsandbytes' default (float32)
            args = copy.copy(self)
            args.dtype = None
        # A quantized model cannot be moved after loading: it is loaded onto the GPU this process trains or
        # generates on (launch.sh makes it this process's first visible one).
        return {"quantization_config": get_quantization_config(args), "device_map": {"": torch.cuda.current_device()}}
