"""Admission: turn a validated body into a `QueuedRequest`, or refuse it before anything is enqueued.

Checks, in order (`_admit`): the model exists; the prompt tokenizes within the vocabulary;
`max_tokens` is within the tenant's per-request limit; prompt plus `max_tokens` fits the
model's context, then what the workers' KV cache holds for one sequence, then the tenant's
tokens per minute; stop strings are within bounds. Each of these is a 400: retrying cannot
help. Last, the tenant's admission limits (`shared/quota.py`; over one, a 429 with
`Retry-After`): the only check that takes something, so nothing after it can refuse the
request and leave its reservation behind (the route releases it if the enqueue fails).
A default `max_tokens` (the request named none) is capped by the tenant's limits instead.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from starlette.concurrency import run_in_threadpool

from api.context import ApiContext
from api.errors import bad_request, model_not_found, rate_limited
from api.schemas import ChatBody, CompletionBody, GenerationBody
from shared import deployments, quota
from shared.protocol import QueuedRequest, SamplingParams
from shared.settings import Settings
from shared.tables import ModelDeployment
from shared.tenants import Principal, TenantLimits

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

Kind = Literal["completion", "chat"]


async def admit_completion(
    ctx: ApiContext, principal: Principal, body: CompletionBody
) -> QueuedRequest:
    deployment = await _deployment(ctx, body.model)
    tokenizer = await ctx.tokenizers.get(deployment)
    if isinstance(body.prompt, str):
        prompt_ids = tokenizer.encode(body.prompt, add_special_tokens=False)
    else:
        prompt_ids = _checked_token_ids(body.prompt, len(tokenizer))
    max_tokens = body.max_tokens or _capped(
        DEFAULT_COMPLETION_MAX_TOKENS, principal.limits, len(prompt_ids)
    )
    return await _admit(ctx, principal, deployment, body, "completion", prompt_ids, max_tokens)


async def admit_chat(ctx: ApiContext, principal: Principal, body: ChatBody) -> QueuedRequest:
    deployment = await _deployment(ctx, body.model)
    tokenizer = await ctx.tokenizers.get(deployment)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt_ids = list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    max_tokens = body.requested_max_tokens or _capped(
        await _default_chat_max_tokens(ctx, deployment, len(prompt_ids)),
        principal.limits,
        len(prompt_ids),
    )
    return await _admit(ctx, principal, deployment, body, "chat", prompt_ids, max_tokens)


async def _admit(
    ctx: ApiContext,
    principal: Principal,
    deployment: ModelDeployment,
    body: GenerationBody,
    kind: Kind,
    prompt_ids: list[int],
    max_tokens: int,
) -> QueuedRequest:
    """The checks every kind of request shares, then the reservation against its limits."""
    num_tokens = len(prompt_ids) + max_tokens
    _check_max_tokens(principal.limits, max_tokens)
    _check_context(deployment, body, len(prompt_ids), max_tokens)
    await _check_kv_capacity(ctx, deployment, len(prompt_ids), max_tokens)
    _check_tokens_per_minute(principal.limits, num_tokens)
    _check_stop(ctx, body.stop_strings)
    queued = _queued(ctx.settings, principal, deployment, body, kind, prompt_ids, max_tokens)
    await _reserve(ctx, principal.limits, queued)
    return queued


def _capped(default_max_tokens: int, limits: TenantLimits, num_prompt_tokens: int) -> int:
    """A default `max_tokens` within the tenant's limits, so that leaving it out never fails."""
    caps = [default_max_tokens, limits.max_tokens_per_request]
    if limits.tokens_per_minute is not None:
        caps.append(limits.tokens_per_minute - num_prompt_tokens)
    return max(min(c for c in caps if c is not None), 1)


def _check_max_tokens(limits: TenantLimits, max_tokens: int) -> None:
    limit = limits.max_tokens_per_request
    if limit is not None and max_tokens > limit:
        raise bad_request(
            f"max_tokens is {max_tokens}; this API key allows at most {limit} per request.",
            param="max_tokens",
            code="max_tokens_exceeds_limit",
        )


def _check_context(
    deployment: ModelDeployment, body: GenerationBody, num_prompt_tokens: int, max_tokens: int
) -> None:
    num_context_tokens = num_prompt_tokens + max_tokens
    if num_context_tokens > deployment.max_context_tokens:
        raise bad_request(
            f"This model's maximum context length is {deployment.max_context_tokens} tokens; "
            f"the request needs {num_context_tokens} ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for max_tokens).",
            param="max_tokens" if body.max_tokens else "messages",
            code="context_length_exceeded",
        )


def _check_tokens_per_minute(limits: TenantLimits, num_tokens: int) -> None:
    # Even a full bucket could never hold such a request: a 429 would have it retry forever.
    limit = limits.tokens_per_minute
    if limit is not None and num_tokens > limit:
        raise bad_request(
            f"The request needs up to {num_tokens} tokens (prompt plus max_tokens); this API "
            f"key allows at most {limit} tokens per minute.",
            param="max_tokens",
            code="request_exceeds_tokens_per_minute",
        )


async def _reserve(ctx: ApiContext, limits: TenantLimits, queued: QueuedRequest) -> None:
    """Take the request's slots and tokens from its tenant's limits, or refuse it (429)."""
    refusal = await quota.admit(ctx.redis, limits, queued, ctx.settings.request_max_lifetime_s)
    if refusal is not None:
        raise rate_limited(refusal.code, _refusal_message(refusal), refusal.retry_after_s)


def _refusal_message(refusal: quota.Refusal) -> str:
    return (
        f"Rate limit reached for {refusal.limit.replace('_', ' ')}: limit {refusal.allowed}. "
        f"Please retry after {refusal.retry_after_s} s."
    )


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
    settings: Settings,
    principal: Principal,
    deployment: ModelDeployment,
    body: GenerationBody,
    kind: Kind,
    prompt_ids: list[int],
    max_tokens: int,
) -> QueuedRequest:
    assert deployment.id is not None
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    now_s = time.time()
    return QueuedRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        tenant_id=principal.tenant_id,
        tier=principal.tier,
        weight=principal.weight,
        content_retention_days=principal.content_retention_days,
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
        arrival_ts=now_s,
        queue_deadline_ts=now_s + settings.request_queue_timeout_s,
        deadline_ts=now_s + settings.request_timeout_s,
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
