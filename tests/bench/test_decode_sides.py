"""The decode sides bench (bench/decode_sides.py): each side's steps take its own path."""

from __future__ import annotations

import pytest

from bench import decode_sides
from worker.runner import cpu_decode, cpu_kernels

_library = cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    _library is None or not _library.few_rows_available(),
    reason="the decode layers need a C compiler and a CPU with AVX512-BF16",
)


def test_each_side_takes_its_path_and_the_rounds_are_timed(monkeypatch):
    """On the default model: the tiny one's 16-wide heads have no fused layer ops, so no
    decode layers."""
    calls: list[str] = []
    for name in ("step", "step_at"):
        method = getattr(cpu_decode.DecodeLayers, name)
        monkeypatch.setattr(
            cpu_decode.DecodeLayers,
            name,
            lambda self, *a, _n=name, _m=method: calls.append(_n) or _m(self, *a),
        )
    result = decode_sides.measure(24, rounds=3, steps=2, baseline=None)
    assert set(result["sides"]) == {"lists", "tensors"}
    for side in result["sides"].values():
        assert len(side["step_ms"]) == 3 and min(side["step_ms"]) > 0
    # 3 warm-up steps a side, then 3 rounds of 2 steps a side: half through each path
    assert calls.count("step_at") == calls.count("step") == 3 + 3 * 2
    first, last = result["context_tokens"]
    assert last - first == 3 * 2 * 2
