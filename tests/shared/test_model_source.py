"""Where weights come from: the built-in default, a GGUF file, a HF directory."""

from __future__ import annotations

import pytest

from shared import model_source


def test_default_is_the_gguf_inside_the_package():
    source = model_source.resolve(model_source.DEFAULT_MODEL_ID)
    assert source.gguf_file and (source.directory / source.gguf_file).is_file()


def test_gguf_path_and_hf_directory(tiny_model_dir):
    default = model_source.resolve(model_source.DEFAULT_MODEL_ID)
    by_path = model_source.resolve(str(default.directory / default.gguf_file))
    assert by_path == default
    assert model_source.max_context_tokens(by_path) == 8192
    hf = model_source.resolve(str(tiny_model_dir))
    assert hf.gguf_file is None and hf.load_kwargs == {}
    assert model_source.max_context_tokens(hf) == 1024


def test_unknown_source_is_refused(tmp_path):
    with pytest.raises(model_source.ModelSourceError):
        model_source.resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(model_source.ModelSourceError):
        model_source.resolve(str(tmp_path))  # a directory without config.json
