"""Large CPU tensors in huge pages, and the forward's weights in one of them."""

from __future__ import annotations

import subprocess
import sys
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
    host_memory.keep_freed_memory()  # as a runner sets it: freed heap memory is kept for reuse
    freed = [torch.empty(4 << 20, dtype=torch.uint8).fill_(1) for _ in range(32)]
    del freed
    tensor = host_memory.zeros((64 << 20,), torch.uint8)  # fresh pages all the same
    tensor.fill_(1)  # first written: mapped now
    assert _huge_kb(tensor.data_ptr()) >= 32 * 1024  # of its 64 MB, THP maps at least half


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


_ROUNDS = """
import resource, sys, torch
from worker.runner import host_memory
if sys.argv[1] == "keep":
    host_memory.keep_freed_memory()
def round_of_steps():  # a step's activations: 64 MB in 4 MB tensors, written, then freed
    tensors = [torch.empty(4 << 20, dtype=torch.uint8).fill_(1) for _ in range(16)]
    del tensors
for _ in range(2):
    round_of_steps()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_of_steps()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_steps_freed_activations_are_not_faulted_in_again():
    faults = subprocess.run(
        [sys.executable, "-c", _ROUNDS, "keep"], capture_output=True, text=True, check=True
    )
    pages = (64 << 20) // 4096
    assert int(faults.stdout) < pages // 4, faults.stdout  # without: every page again
