"""A sequence's KV blocks handed from one worker's runner to another's over ZeroMQ (issue 22):
the receiving runner continues the sequence exactly as the sender would have, and a transfer
nobody acknowledges, or one of another layout, fails cleanly."""

from __future__ import annotations

import threading

import pytest
import torch

from shared.protocol import SamplingParams
from tests import tiny_model
from worker.kv_link import KVReceiver, KVSender, KVTransfer, KVTransferError
from worker.runner.kv_blocks import KVLayout
from worker.runner.model_runner import ModelRunner
from worker.step_batch import ChunkInput, StepBatch

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def loaded():
    return tiny_model.attentive("llama")


def _decode(runner: ModelRunner, tokens: list[int], blocks: list[int], steps: int) -> list[int]:
    """`steps` greedy decodes of a sequence whose first len(tokens) - 1 tokens are in the pool."""
    out = []
    for _ in range(steps):
        chunk = ChunkInput("r", [tokens[-1]], len(tokens) - 1, blocks, GREEDY)
        token = runner.execute(StepBatch([chunk], []))[0]
        tokens = [*tokens, token]
        out.append(token)
    return out


def test_the_receiving_runner_continues_the_sequence_as_the_sender_would(loaded):
    prompt = list(range(1000, 1030))  # 30 tokens; with 12 decodes, 11 blocks of 4
    sender_blocks, receiver_blocks = list(range(0, 11)), list(range(20, 31))
    prefill = ChunkInput("r", prompt, 0, sender_blocks, GREEDY)
    sender_runner = ModelRunner(loaded, 32, BLOCK_SIZE, "own")
    first = sender_runner.execute(StepBatch([], [prefill]))[0]

    receiver_runner = ModelRunner(loaded, 32, BLOCK_SIZE, "own")
    receiver = KVReceiver("tcp://127.0.0.1:0")
    sender = KVSender()

    def accept(transfer: KVTransfer) -> None:
        layout = KVLayout.from_dict(transfer.header["layout"])
        receiver_runner.import_kv(
            receiver_blocks[: transfer.header["num_blocks"]], layout, transfer.payload
        )

    served = threading.Thread(target=receiver.serve_one, args=(10.0, accept))
    served.start()
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    payload = sender_runner.export_kv(sender_blocks[:num_blocks])
    assert len(payload) == num_blocks * sender_runner.kv_layout.block_nbytes
    header = {"request_id": "r", "layout": sender_runner.kv_layout.as_dict(),
              "num_tokens": len(prompt), "num_blocks": num_blocks}  # fmt: skip
    sender.send(receiver.endpoint, header, payload, timeout_s=10.0)
    served.join()

    expected = _decode(sender_runner, [*prompt, first], sender_blocks, 12)
    got = _decode(receiver_runner, [*prompt, first], receiver_blocks, 12)
    assert got == expected
    # Without the blocks the receiver's tokens would be another sequence's: the test can fail.
    blank = ModelRunner(loaded, 32, BLOCK_SIZE, "own")
    assert _decode(blank, [*prompt, first], receiver_blocks, 12) != expected
    sender.close()
    receiver.close()


def test_a_transfer_nobody_answers_fails_within_its_timeout():
    receiver = KVReceiver("tcp://127.0.0.1:0")  # bound, never serving
    sender = KVSender()
    header = {"request_id": "r", "layout": {}, "num_tokens": 1, "num_blocks": 1}
    with pytest.raises(KVTransferError, match="no answer"):
        sender.send(receiver.endpoint, header, b"\0" * 64, timeout_s=0.3)
    sender.close()
    receiver.close()


def test_blocks_of_another_layout_are_refused_and_the_sender_is_told(loaded):
    runner = ModelRunner(loaded, 8, BLOCK_SIZE, "own")
    before = runner.export_kv(list(range(8))).tobytes()
    receiver = KVReceiver("tcp://127.0.0.1:0")
    sender = KVSender()
    other = KVLayout(**{**runner.kv_layout.as_dict(), "block_size": 16})
    header = {"request_id": "r", "layout": other.as_dict(), "num_tokens": 3, "num_blocks": 1}

    def accept(transfer: KVTransfer) -> None:
        layout = KVLayout.from_dict(transfer.header["layout"])
        runner.import_kv([0], layout, transfer.payload)

    served = threading.Thread(target=receiver.serve_one, args=(10.0, accept))
    served.start()
    with pytest.raises(KVTransferError, match="does not match"):
        sender.send(receiver.endpoint, header, b"\1" * other.block_nbytes, timeout_s=10.0)
    served.join()
    assert runner.export_kv(list(range(8))).tobytes() == before  # nothing written
    with pytest.raises(ValueError, match="bytes of KV"):
        runner.import_kv([0, 1], runner.kv_layout, b"\0" * runner.kv_layout.block_nbytes)
    sender.close()
    receiver.close()


def test_a_bf16_pool_round_trips_bit_for_bit():
    loaded = tiny_model.attentive("llama")
    loaded.model.to(torch.bfloat16)
    runner = ModelRunner(loaded, 8, BLOCK_SIZE, "own")
    assert runner.kv_layout.dtype == "bfloat16"
    k_pool, v_pool = runner._k_pool, runner._v_pool
    generator = torch.Generator().manual_seed(0)
    k_pool.copy_(torch.randn(k_pool.shape, generator=generator))
    v_pool.copy_(torch.randn(v_pool.shape, generator=generator))
    payload = runner.export_kv([5, 2])
    other = ModelRunner(loaded, 8, BLOCK_SIZE, "own")
    other.import_kv([0, 1], runner.kv_layout, bytes(payload))
    assert torch.equal(other._k_pool[:, :, 0], k_pool[:, :, 5])
    assert torch.equal(other._v_pool[:, :, 1], v_pool[:, :, 2])
    assert not other._k_pool[:, :, 2:].any()
