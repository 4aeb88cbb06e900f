"""Admission: turn a validated body into a `QueuedRequest`, or refuse it before anything is enqueued.

Checks, in order: the model exists; the prompt tokenizes within the vocabulary; stop
strings are within bounds; prompt plus `max_tokens` fits the model's context.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from starlette.concurrency import run_in_threadpool

from api.context import ApiContext
from api.errors import bad_request, model_not_found
from api.schemas import ChatBody, CompletionBody, GenerationBody
from shared import deployments
from shared.protocol import QueuedRequest, SamplingParams
from shared.tables import ModelDeployment
from shared.tenants import Principal

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


async def admit_completion(
    ctx: ApiContext, principal: Principal, body: CompletionBody
) -> QueuedRequest:
    deployment = await _deployment(ctx, body.model)
    tokenizer = await ctx.tokenizers.get(deployment)
    if isinstance(body.prompt, str):
        prompt_ids = tokenizer.encode(body.prompt, add_special_tokens=False)
    else:
        prompt_ids = _checked_token_ids(body.prompt, len(tokenizer))
    max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    await _check_kv_capacity(ctx, deployment, len(prompt_ids), max_tokens)
    return _queued(ctx, principal, deployment, body, "completion", prompt_ids, max_tokens)


async def admit_chat(ctx: ApiContext, principal: Principal, body: ChatBody) -> QueuedRequest:
    deployment = await _deployment(ctx, body.model)
    tokenizer = await ctx.tokenizers.get(deployment)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    max_tokens = body.requested_max_tokens or await _default_chat_max_tokens(
        ctx, deployment, len(prompt_ids)
    )
    await _check_kv_capacity(ctx, deployment, len(prompt_ids), max_tokens)
    return _queued(ctx, principal, deployment, body, "chat", list(prompt_ids), max_tokens)


async def _default_chat_max_tokens(
    ctx: ApiContext, deployment: ModelDeployment, num_prompt_tokens: int
) -> int:
    # Without a limit, a chat answer may use the rest of the context (as OpenAI's API does),
    # or of what the workers' KV cache can hold for one sequence, if that is less.
    limit = deployment.max_context_tokens
    if (capacity := await ctx.kv_capacity.max_tokens(deployment.model_id)) is not None:
        limit = min(limit, capacity)
    return max(limit - num_prompt_tokens, 1)


async def _check_kv_capacity(
    ctx: ApiContext, deployment: ModelDeployment, num_prompt_tokens: int, max_tokens: int
) -> None:
    """Refuse, before enqueueing, a request no worker's KV cache could ever hold."""
    capacity = await ctx.kv_capacity.max_tokens(deployment.model_id)
    if capacity is not None and num_prompt_tokens + max_tokens > capacity:
        raise bad_request(
            f"The request needs up to {num_prompt_tokens + max_tokens} tokens of KV cache "
            f"({num_prompt_tokens} in the prompt, {max_tokens} for max_tokens); the workers "
            f"serving `{deployment.model_id}` hold at most {capacity} per sequence.",
            param="max_tokens",
            code="context_length_exceeded",
        )


async def _deployment(ctx: ApiContext, model: str) -> ModelDeployment:
    deployment = await run_in_threadpool(deployments.get_active, ctx.engine, model)
    if deployment is None:
        raise model_not_found(model)
    return deployment


def _checked_token_ids(token_ids: list[int], vocab_size: int) -> list[int]:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"prompt: token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                param="prompt",
                code="invalid_value",
            )
    return token_ids


def _queued(
    ctx: ApiContext,
    principal: Principal,
    deployment: ModelDeployment,
    body: GenerationBody,
    kind: Literal["completion", "chat"],
    prompt_ids: list[int],
    max_tokens: int,
) -> QueuedRequest:
    _check_stop(ctx, body.stop_strings)
    num_context_tokens = len(prompt_ids) + max_tokens
    if num_context_tokens > deployment.max_context_tokens:
        raise bad_request(
            f"This model's maximum context length is {deployment.max_context_tokens} tokens; "
            f"the request needs {num_context_tokens} ({len(prompt_ids)} in the prompt, "
            f"{max_tokens} for max_tokens).",
            param="max_tokens" if body.max_tokens else "messages",
            code="context_length_exceeded",
        )
    assert deployment.id is not None
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    return QueuedRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        tenant_id=principal.tenant_id,
        tier=principal.tier,
        weight=principal.weight,
        model=deployment.model_id,
        deployment_id=deployment.id,
        kind=kind,
        prompt_token_ids=prompt_ids,
        sampling=SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_strings,
            stop_token_ids=tuple(body.stop_token_ids),
            ignore_eos=body.ignore_eos,
        ),
        arrival_ts=time.time(),
    )


def _check_stop(ctx: ApiContext, stops: tuple[str, ...]) -> None:
    settings = ctx.settings
    if len(stops) > settings.max_stop_strings:
        raise bad_request(f"stop: at most {settings.max_stop_strings} stop strings", param="stop")
    if any(len(s) > settings.max_stop_string_chars for s in stops):
        raise bad_request(
            f"stop: each stop string is at most {settings.max_stop_string_chars} characters",
            param="stop",
        )
