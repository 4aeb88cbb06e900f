"""Incremental detokenization and stop strings, on the real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import model_source
from worker.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(settings_home):
    return model_source.load_tokenizer(
        model_source.resolve(model_source.DEFAULT_MODEL_ID), settings_home / "cache"
    )


@pytest.fixture(scope="module")
def settings_home(tmp_path_factory):
    return tmp_path_factory.mktemp("detok")


def _stream(tokenizer, text: str, stop: tuple[str, ...] = ()) -> tuple[str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    out = ""
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        out += detok.add_token(token_id)
        if detok.is_stopped:
            return out, detok
    return out + detok.flush(), detok


@pytest.mark.parametrize(
    "text", ["Hello, world!", "naïve café \u2013 東京 🎉 ok", "  spaced  out \n lines"]
)
def test_streamed_text_equals_full_decode(tokenizer, text):
    out, _ = _stream(tokenizer, text)
    assert out == text


def test_stop_string_is_cut_and_never_sent(tokenizer):
    out, detok = _stream(tokenizer, "one two three four", stop=("three",))
    assert detok.is_stopped
    assert out == "one two "


def test_partial_stop_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ("STOP",))
    sent = ""
    for token_id in tokenizer.encode("a STO b", add_special_tokens=False):
        sent += detok.add_token(token_id)
    assert not detok.is_stopped
    assert "STO" not in sent  # could still have become "STOP"
    assert sent + detok.flush() == "a STO b"


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=1, max_size=40), stop=st.text(min_size=1, max_size=4))
def test_output_is_prefix_before_first_stop(tokenizer, text, stop):
    # Property: whatever the text, what is sent is the decoded text up to the first stop.
    decoded = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
    out, _ = _stream(tokenizer, text, stop=(stop,))
    expected = decoded.split(stop, 1)[0]
    assert out == expected
