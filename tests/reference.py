"""The correctness references: what `model.generate` gives one request alone (the engines),
and what torch's matmul gives (the C matmul kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def greedy_alone(loaded, prompt_ids: list[int], max_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    out = loaded.model.generate(
        input_ids,
        # Explicit: on SmolLM2 the pad token is <|im_end|>, which generate would mask.
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=loaded.pad_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


def bf16_matmul_case(rows: int, n: int, k: int, with_bias: bool):
    """x [rows, k], weight [n, k] and bias [n] or None, bf16, seeded by the shape."""
    generator = torch.Generator().manual_seed(rows * 1000 + n)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    return x, weight, bias


def assert_within_rounding_of_torch(got, x, weight, bias) -> None:
    """`got` is torch's `F.linear` but for fp32 sums in another order: equal but in a few
    elements, which differ by a bf16 rounding step or, where the terms cancel, by fp32
    rounding of the terms' magnitude."""
    expected = F.linear(x, weight, bias)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert (got != expected).float().mean().item() <= 0.01
    magnitude = x.float().abs() @ weight.float().abs().T
    bound = expected.float().abs() * 2**-7 + magnitude * 2**-14
    assert ((got.float() - expected.float()).abs() <= bound).all()
