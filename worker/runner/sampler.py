"""Per-request sampling: every row of a batch keeps its own temperature, top-p, top-k and seed.

Sampling is the one part of a step that belongs to a single sequence (the forward pass is
shared), so it fails per sequence: a row whose parameters cannot be sampled gets a
`SamplingFailure` instead of a token, and every other row keeps its token.
"""

from __future__ import annotations

import torch

from shared.protocol import SamplingParams
from worker.runner import cpu_kernels
from worker.runner.guard import check
from worker.step_batch import SamplingFailure


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private RNG per request, so a seeded request samples the same tokens in any batch.
    None for greedy decoding, and for parameters `check` refuses (`sample` fails that row)."""
    if params.is_greedy or check(params) is not None:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int | SamplingFailure]:
    """One token id per row of `logits` ([batch, vocab]), or that row's `SamplingFailure`."""
    results: list[int | SamplingFailure] = list(greedy_tokens(logits))
    rows = []
    for row, p in enumerate(params):
        if (problem := check(p)) is not None:
            results[row] = SamplingFailure(problem)
        elif not p.is_greedy:
            rows.append(row)
    if not rows:
        return results
    temperatures = torch.tensor([params[r].temperature for r in rows], device=logits.device)
    scaled = logits[rows].float() / temperatures[:, None]
    is_usable = _is_usable(scaled)
    for i, row in enumerate(rows):
        if not is_usable[i]:
            message = f"temperature {params[row].temperature!r} overflows the logits"
            results[row] = SamplingFailure(message)
            continue
        try:
            results[row] = _sample_row(scaled[i], params[row], generators[row])
        except (RuntimeError, ValueError) as exc:  # the last line: only this row fails
            results[row] = SamplingFailure(f"sampling failed: {type(exc).__name__}")
    return results


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, as `torch.argmax` gives it (the first largest; the first NaN where a
    row has one). On the CPU in `csrc/argmax.c`: torch's CPU argmax reads a value at a time,
    1.5 ms for 32 rows of a 49k vocabulary, 5-6% of a batch-32 step (session 28)."""
    library = cpu_kernels.load() if logits.device.type == "cpu" else None
    is_bf16 = logits.dtype == torch.bfloat16
    if library is None or not (is_bf16 or logits.dtype == torch.float32) or logits.dim() != 2:
        return logits.float().argmax(dim=-1).tolist()
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library.argmax_rows(logits.data_ptr(), out.data_ptr(), *logits.shape, int(is_bf16))
    return out.tolist()


def _is_usable(scaled: torch.Tensor) -> list[bool]:
    """Per row: no NaN or +inf, and some finite logit, so softmax gives a distribution.

    A tiny temperature overflows float32 (1e-40 scales a logit of 1 past 3.4e38; 5e-324 is 0
    in float32) and softmax then yields NaN. Checked for all rows in one transfer: on CUDA,
    `multinomial` on NaN is a device-side assert that poisons the process, not an exception.
    """
    has_no_nan_or_inf = (scaled.isfinite() | scaled.isneginf()).all(-1)
    return (has_no_nan_or_inf & scaled.isfinite().any(-1)).tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """A token from one row of logits already divided by the temperature."""
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = sorted_probs.cumsum(-1) - sorted_probs > p.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
