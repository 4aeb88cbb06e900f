"""End to end with the real default model (SmolLM2-135M-Instruct from its GGUF file)."""

from __future__ import annotations

import pytest

from shared.model_source import DEFAULT_MODEL_ID
from tests.helpers import get_usage, stream

pytestmark = pytest.mark.slow


def test_streamed_completion_with_real_model(api_url, real_worker, make_tenant):
    _, key = make_tenant("real")
    body = {
        "model": DEFAULT_MODEL_ID,
        "prompt": "The capital of France is",
        "max_tokens": 16,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    result = stream(api_url, "/v1/completions", key, body)
    assert result.status_code == 200 and result.has_done
    assert "Paris" in result.text
    request_id = result.headers["x-request-id"]
    usage = get_usage(api_url, key, request_id).json()
    assert usage["input_tokens"] == result.usage["prompt_tokens"]
    assert usage["output_tokens"] == result.usage["completion_tokens"]


def test_chat_answers_a_real_question(api_url, real_worker, make_tenant):
    _, key = make_tenant("real-chat")
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 40,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    result = stream(api_url, "/v1/chat/completions", key, body)
    assert result.has_done
    assert "Paris" in result.text
    # The model ends its turn with <|im_end|>: a natural stop, and the token is not shown.
    assert result.finish_reasons[-1] == "stop"
    assert "<|im_end|>" not in result.text
