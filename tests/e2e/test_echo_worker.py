"""A platform whose worker runs the echo engine (`llmfleet worker --engine echo`): a client
gets exactly the echoed tokens over SSE, and the ledger records exactly their usage."""

from __future__ import annotations

import pytest

from shared import deployments, model_source
from tests.helpers import get_usage, stream, wait_for_usage_record

ECHO_MODEL_ID = "tiny-echo"  # a deployment of its own: no model worker serves it


@pytest.fixture(scope="module")
def echo_deployment(db, tiny_model_dir):
    return deployments.register(db, ECHO_MODEL_ID, str(tiny_model_dir))


@pytest.fixture(scope="module")
def echo_worker(start_worker, echo_deployment):
    # 50 tokens a second per sequence, in steps of 10 ms: two slices of the sequences.
    return start_worker(
        ECHO_MODEL_ID, "--engine", "echo", "--echo-tokens-per-s", "50", "--echo-step-ms", "10",
        "--max-num-seqs", "4",
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return model_source.load_tokenizer(model_source.resolve(str(tiny_model_dir)))


def test_echo_worker_streams_the_echoed_tokens_with_exact_usage(
    api_url, echo_worker, tokenizer, make_tenant, db
):
    _, key = make_tenant("echo")
    prompt_ids = tokenizer.encode(" the quick brown fox", add_special_tokens=False)
    max_tokens = 2 * len(prompt_ids) + 1
    body = {
        "model": ECHO_MODEL_ID,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
    }
    result = stream(api_url, "/v1/completions", key, body)
    assert result.status_code == 200 and result.has_done
    echoed = [prompt_ids[i % len(prompt_ids)] for i in range(max_tokens)]
    assert result.text == tokenizer.decode(echoed, skip_special_tokens=True)
    assert result.finish_reasons[-1] == "length"
    assert result.usage == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": max_tokens,
        "total_tokens": len(prompt_ids) + max_tokens,
    }
    request_id = result.headers["x-request-id"]
    record = wait_for_usage_record(db, request_id)
    assert (record.input_tokens, record.output_tokens) == (len(prompt_ids), max_tokens)
    assert record.computed_tokens == len(prompt_ids) + max_tokens - 1
    assert record.finish_reason == "length"
    assert get_usage(api_url, key, request_id).json()["output_tokens"] == max_tokens


def test_echo_worker_honours_a_stop_string(api_url, echo_worker, tokenizer, make_tenant, db):
    _, key = make_tenant("echo")
    prompt_ids = tokenizer.encode(" red green blue", add_special_tokens=False)
    body = {"model": ECHO_MODEL_ID, "prompt": prompt_ids, "max_tokens": 40, "stop": ["blue red"]}
    result = stream(api_url, "/v1/completions", key, body)
    assert result.status_code == 200 and result.has_done
    assert result.text == " red green "  # the echo's second " red" completes the stop string
    assert result.finish_reasons[-1] == "stop"
    record = wait_for_usage_record(db, result.headers["x-request-id"])
    assert record.output_tokens == len(prompt_ids) + 1
