"""Save a deployment's weights as a plain Hugging Face directory, for a peer server (vLLM)
that cannot read our GGUF file: `python -m bench.export_hf OUT_DIR [SOURCE]`.

A GGUF-loaded model refuses `save_pretrained`, so a fresh model is built from its config,
given the de-quantized state dict, and saved with the tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path


def export(source: str, out_dir: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shared import model_source

    resolved = model_source.resolve(source)
    loaded = AutoModelForCausalLM.from_pretrained(
        resolved.directory, dtype=torch.float32, **resolved.load_kwargs
    )
    config = AutoConfig.from_pretrained(resolved.directory, **resolved.load_kwargs)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out_dir)
    model_source.load_tokenizer(resolved).save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    export(sys.argv[2] if len(sys.argv) > 2 else "smollm2-135m", Path(sys.argv[1]))
