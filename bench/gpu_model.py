"""The GPU check's model where the default's GGUF file (94 MiB) cannot travel to the GPU
machine: its shape here, seeded random weights of that shape there.

    python -m bench.gpu_model export-shape OUT_DIR [SOURCE]   # here: config and tokenizer
    python -m bench.gpu_model random-model SHAPE_DIR OUT_DIR   # there: a model directory
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from shared import model_source
from worker.runner import loader


def export_shape(source: str, out_dir: Path) -> Path:
    """The default model's config, generation config and tokenizer, without its weights
    (2 MB, where the GGUF file is 94 MiB): what `random_model` needs on a GPU machine."""
    resolved = model_source.resolve(source)
    loaded = loader.load(resolved, "cpu", "float32")
    config = loaded.model.config
    if hasattr(config, "quantization_config"):  # the GGUF file's; the weights are not here
        del config.quantization_config
    config.save_pretrained(out_dir)
    loaded.model.generation_config.save_pretrained(out_dir)
    model_source.load_tokenizer(resolved).save_pretrained(out_dir)
    return out_dir


def random_model(shape_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A model directory of `export_shape`'s shape with seeded random weights: a step costs
    what the real model's does (same shapes; the benchmarks' outputs have fixed lengths),
    and the engine can still be checked token for token against `generate` on it."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(shape_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig.from_pretrained(shape_dir)
    model.save_pretrained(out_dir)
    model_source.load_tokenizer(model_source.ModelSource(shape_dir)).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "export-shape":
        source = argv[2] if len(argv) > 2 else model_source.DEFAULT_MODEL_ID
        print(export_shape(source, Path(argv[1])))
    elif len(argv) == 3 and argv[0] == "random-model":
        print(random_model(Path(argv[1]), Path(argv[2])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
