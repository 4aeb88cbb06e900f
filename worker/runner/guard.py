"""What a sequence must satisfy before it may share a model step with other tenants' work.

A step carries many requests, so a request whose input the model or the sampler cannot take
is refused alone when it is added, never discovered by a failed step (which costs everyone
in it a recompute: `Scheduler.step_failed`). On CUDA the door matters more: an embedding
index out of range, or `multinomial` on NaN, is a device-side assert that poisons the
process's CUDA context, not an exception anyone can catch. The API bounds these values too;
this is the worker's own line, for whatever reaches its stream.
"""

from __future__ import annotations

import math

from shared.protocol import ErrorCode, SamplingParams

# `torch.Generator.manual_seed` takes any 64-bit value, signed or unsigned (it wraps a
# negative one); anything wider raises.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# Below this a temperature's reciprocal overflows float32: no logit can be divided by it.
# float32's largest value, `torch.finfo(torch.float32).max`, written out so that the guard
# (and the engine that calls it) imports no torch.
FLOAT32_MAX = (2 - 2**-23) * 2.0**127
MIN_TEMPERATURE = 1.0 / FLOAT32_MAX


def refusal(
    prompt_token_ids: list[int], sampling: SamplingParams, vocab_size: int
) -> tuple[ErrorCode, str] | None:
    """Why a request cannot run on a model of `vocab_size` tokens (its error code and
    message), or None."""
    if (problem := check(sampling)) is not None:
        return ErrorCode.INVALID_SAMPLING_PARAMS, problem
    if any(not 0 <= token_id < vocab_size for token_id in prompt_token_ids):
        outside = f"a prompt token id is outside the vocabulary (0..{vocab_size - 1})"
        return ErrorCode.INVALID_PROMPT, outside
    return None


def check(params: SamplingParams) -> str | None:
    """What makes `params` unusable by the sampler, or None. Plain Python, no tensor: it runs
    when a sequence is added, before it can share a step with anyone, and again in the
    sampler for each row."""
    seed = params.seed
    if seed is not None and (
        not isinstance(seed, int) or isinstance(seed, bool) or not MIN_SEED <= seed <= MAX_SEED
    ):
        return f"seed must be an integer from {MIN_SEED} to {MAX_SEED}"
    temperature = params.temperature
    if not (math.isfinite(temperature) and (temperature == 0.0 or temperature >= MIN_TEMPERATURE)):
        return f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:.1e}"
    if not 0.0 < params.top_p <= 1.0:
        return "top_p must be in (0, 1]"
    if params.top_k < 0:
        return "top_k must be >= 0"
    return None
