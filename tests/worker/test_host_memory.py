"""Large CPU tensors in huge pages, and the forward's weights in one of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import tiny_model
from worker.runner import host_memory
from worker.runner.llama import LlamaForward

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_are_zero_aligned_and_shaped():
    tensor = host_memory.zeros((3, 5, 7), torch.bfloat16)
    assert tensor.shape == (3, 5, 7) and tensor.dtype == torch.bfloat16
    assert tensor.is_contiguous() and tensor.data_ptr() % host_memory.HUGE_PAGE_BYTES == 0
    assert not tensor.any()


@pytest.mark.skipif(
    not _THP.exists() or "[never]" in _THP.read_text(), reason="no transparent huge pages"
)
def test_written_zeros_are_mapped_in_huge_pages():
    tensor = host_memory.zeros((16 << 20,), torch.uint8)
    tensor.fill_(1)  # first written: mapped now
    assert _huge_kb(tensor.data_ptr()) >= 8 * 1024  # of its 16 MB, THP maps at least half


def test_the_forward_reads_its_weights_from_one_tensor_in_decode_order():
    loaded = tiny_model.attentive("llama")
    model = loaded.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    forward = LlamaForward(model)
    linears = [
        w for layer in forward.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    weights = [linear.weight for linear in [*linears, forward.lm_head]]
    start = weights[0].data_ptr()
    assert start % host_memory.HUGE_PAGE_BYTES == 0
    for weight in weights:  # back to back, each where the one before it ended
        assert weight.data_ptr() == start
        start += weight.numel() * weight.element_size()
    # the HF modules share them (generate reads the same memory), values unchanged
    layer = model.model.layers[0]
    assert layer.self_attn.k_proj.weight.data_ptr() > forward.layers[0].qkv.weight.data_ptr()
    assert model.lm_head.weight.data_ptr() == forward.lm_head.weight.data_ptr()
    assert model.model.embed_tokens.weight.data_ptr() == forward.embed.data_ptr()  # tied
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
