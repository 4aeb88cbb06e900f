"""What a sequence must satisfy before it may share a model step with other tenants' work.

A step carries many requests, so a request whose input the model or the sampler cannot take
is refused alone when it is added, never discovered by a failed step (which costs everyone
in it a recompute: `Scheduler.step_failed`). On CUDA the door matters more: an embedding
index out of range, or `multinomial` on NaN, is a device-side assert that poisons the
process's CUDA context, not an exception anyone can catch. The API bounds these values too;
this is the worker's own line, for whatever reaches its stream.
"""

from __future__ import annotations

from shared.protocol import ErrorCode, SamplingParams
from worker.runner import sampler


def refusal(
    prompt_token_ids: list[int], sampling: SamplingParams, vocab_size: int
) -> tuple[ErrorCode, str] | None:
    """Why a request cannot run on a model of `vocab_size` tokens (its error code and
    message), or None."""
    if (problem := sampler.check(sampling)) is not None:
        return ErrorCode.INVALID_SAMPLING_PARAMS, problem
    if any(not 0 <= token_id < vocab_size for token_id in prompt_token_ids):
        outside = f"a prompt token id is outside the vocabulary (0..{vocab_size - 1})"
        return ErrorCode.INVALID_PROMPT, outside
    return None
