"""Admission: turn a validated body into a `QueuedRequest`, or refuse it before anything is enqueued.

Checks, in order: the model exists (404), and which of its versions serves the request
(`api/router.py`; a pinned `model@version` that does not exist is a 404 too). Then the tenant's limits that need no tokens
(`_slot_taken`: requests in flight, queued, per minute; a 429 with `Retry-After`), before
any costly work, so a tenant over its limits costs no tokenizing. Then the prompt: at most
`max_prompt_chars_per_context_token` characters per token of the model's context
(`prompt_too_long`), tokenized off the event loop on the tokenizer threads (chat messages
through the model's chat template, their text never read as control tokens:
`api/prompts.py`) and within the vocabulary; `max_tokens` within the tenant's per-request
limit; prompt plus `max_tokens` within the model's context, then what the workers' KV cache
holds for one sequence, then the tenant's tokens per minute; stop strings within bounds.
Each of these is a 400: retrying cannot help. Last, the tokens are taken from the tenant's
tokens per minute (or 429). A request refused after its slot was taken gives the slot back,
but counts against its requests per minute (`quota.free_slots`); one admitted whose enqueue
then fails is released entirely by the route (`quota.release`).
A default `max_tokens` (the request named none) is capped by the tenant's limits instead.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import anyio

from api import prompts
from api.context import ApiContext
from api.errors import APIError, bad_request, rate_limited
from api.schemas import ChatBody, CompletionBody, GenerationBody
from shared import quota
from shared.protocol import QueuedRequest, SamplingParams
from shared.settings import Settings
from shared.tables import ModelDeployment
from shared.tenants import Principal, TenantLimits

log = logging.getLogger("llmfleet.api")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

Kind = Literal["completion", "chat"]


async def admit_completion(
    ctx: ApiContext, principal: Principal, body: CompletionBody
) -> QueuedRequest:
    deployment = await ctx.router.route(body.model, principal.tenant_id, body.user)
    request_id = _new_request_id("completion")
    async with _slot_taken(ctx, principal, request_id):
        prompt_ids = await _completion_prompt_ids(ctx, principal, deployment, body.prompt)
        max_tokens = body.max_tokens or _capped(
            DEFAULT_COMPLETION_MAX_TOKENS, principal.limits, len(prompt_ids)
        )
        return await _admit(
            ctx, principal, deployment, body, "completion", request_id, prompt_ids, max_tokens
        )


async def admit_chat(ctx: ApiContext, principal: Principal, body: ChatBody) -> QueuedRequest:
    deployment = await ctx.router.route(body.model, principal.tenant_id, body.user)
    request_id = _new_request_id("chat")
    async with _slot_taken(ctx, principal, request_id):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        num_chars = sum(len(m["content"]) for m in messages)
        _check_prompt_chars(ctx.settings, deployment, num_chars, param="messages")
        tokenizer = await ctx.tokenizers.get(deployment)
        prompt_ids = await ctx.tokenizer_threads.run(
            principal.tenant_id, prompts.chat_ids, tokenizer, messages
        )
        max_tokens = body.requested_max_tokens or _capped(
            await _default_chat_max_tokens(ctx, deployment, len(prompt_ids)),
            principal.limits,
            len(prompt_ids),
        )
        return await _admit(
            ctx, principal, deployment, body, "chat", request_id, prompt_ids, max_tokens
        )


@asynccontextmanager
async def _slot_taken(
    ctx: ApiContext, principal: Principal, request_id: str
) -> AsyncIterator[None]:
    """Take the request's slots and one request of its rate, or refuse it (429); if admission
    then refuses it, give the slots back (the request still counts against its rate)."""
    refusal = await quota.admit_request(
        ctx.redis,
        principal.limits,
        principal.tenant_id,
        request_id,
        ctx.settings.request_max_lifetime_s,
    )
    if refusal is not None:
        raise _rate_limited(refusal)
    try:
        yield
    except BaseException:
        # Shielded: a handler cancelled mid-admission must still give its slots back.
        with anyio.CancelScope(shield=True):
            try:
                await quota.free_slots(ctx.redis, principal.tenant_id, request_id)
            except Exception:
                # Redis is likely down; the slots expire after `request_max_lifetime_s`.
                log.exception("could not free the admission slots of %s", request_id)
        raise


async def _completion_prompt_ids(
    ctx: ApiContext, principal: Principal, deployment: ModelDeployment, prompt: str | list[int]
) -> list[int]:
    if isinstance(prompt, list):
        return _checked_token_ids(prompt, await ctx.tokenizers.vocab_size(deployment))
    _check_prompt_chars(ctx.settings, deployment, len(prompt), param="prompt")
    tokenizer = await ctx.tokenizers.get(deployment)
    return await ctx.tokenizer_threads.run(
        principal.tenant_id, prompts.completion_ids, tokenizer, prompt
    )


async def _admit(
    ctx: ApiContext,
    principal: Principal,
    deployment: ModelDeployment,
    body: GenerationBody,
    kind: Kind,
    request_id: str,
    prompt_ids: list[int],
    max_tokens: int,
) -> QueuedRequest:
    """The checks every kind of request shares, then the reservation of its tokens."""
    num_tokens = len(prompt_ids) + max_tokens
    _check_max_tokens(principal.limits, max_tokens)
    _check_context(deployment, body, len(prompt_ids), max_tokens)
    await _check_kv_capacity(ctx, deployment, len(prompt_ids), max_tokens)
    _check_tokens_per_minute(principal.limits, num_tokens)
    _check_stop(ctx, body.stop_strings)
    queued = _queued(
        ctx.settings, principal, deployment, body, kind, request_id, prompt_ids, max_tokens
    )
    await _reserve_tokens(ctx, principal.limits, queued)
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


async def _reserve_tokens(ctx: ApiContext, limits: TenantLimits, queued: QueuedRequest) -> None:
    """Take the request's tokens from its tenant's tokens per minute, or refuse it (429)."""
    settings = ctx.settings
    refusal = await quota.admit_tokens(ctx.redis, limits, queued, settings.request_max_lifetime_s)
    if refusal is not None:
        raise _rate_limited(refusal)


def _rate_limited(refusal: quota.Refusal) -> APIError:
    message = (
        f"Rate limit reached for {refusal.limit.replace('_', ' ')}: limit {refusal.allowed}. "
        f"Please retry after {refusal.retry_after_s} s."
    )
    return rate_limited(refusal.code, message, refusal.retry_after_s)


def _check_prompt_chars(
    settings: Settings, deployment: ModelDeployment, num_chars: int, param: str
) -> None:
    # Before tokenizing, its cost's bound: no prompt this long can fit the context anyway.
    max_num_chars = settings.max_prompt_chars_per_context_token * deployment.max_context_tokens
    if num_chars > max_num_chars:
        raise bad_request(
            f"The prompt has {num_chars} characters; this model takes at most {max_num_chars} "
            f"({settings.max_prompt_chars_per_context_token} per token of its "
            f"{deployment.max_context_tokens}-token context).",
            param=param,
            code="prompt_too_long",
        )


async def _default_chat_max_tokens(
    ctx: ApiContext, deployment: ModelDeployment, num_prompt_tokens: int
) -> int:
    # Without a limit, a chat answer may use the rest of the context (as OpenAI's API does),
    # or of what the workers' KV cache can hold for one sequence, if that is less.
    limit = deployment.max_context_tokens
    if (capacity := await ctx.kv_capacity.max_tokens(deployment.name)) is not None:
        limit = min(limit, capacity)
    return max(limit - num_prompt_tokens, 1)


async def _check_kv_capacity(
    ctx: ApiContext, deployment: ModelDeployment, num_prompt_tokens: int, max_tokens: int
) -> None:
    """Refuse, before enqueueing, a request no worker's KV cache could ever hold."""
    capacity = await ctx.kv_capacity.max_tokens(deployment.name)
    if capacity is not None and num_prompt_tokens + max_tokens > capacity:
        raise bad_request(
            f"The request needs up to {num_prompt_tokens + max_tokens} tokens of KV cache "
            f"({num_prompt_tokens} in the prompt, {max_tokens} for max_tokens); the workers "
            f"serving `{deployment.name}` hold at most {capacity} per sequence.",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _checked_token_ids(token_ids: list[int], vocab_size: int) -> list[int]:
    # `min` and `max` first: a walk in Python over a 1 MB body's ids holds the event loop.
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return token_ids
    token_id = next(t for t in token_ids if not 0 <= t < vocab_size)
    raise bad_request(
        f"prompt: token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
        param="prompt",
        code="invalid_value",
    )


def _new_request_id(kind: Kind) -> str:
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


def _queued(
    settings: Settings,
    principal: Principal,
    deployment: ModelDeployment,
    body: GenerationBody,
    kind: Kind,
    request_id: str,
    prompt_ids: list[int],
    max_tokens: int,
) -> QueuedRequest:
    assert deployment.id is not None
    now_s = time.time()
    return QueuedRequest(
        request_id=request_id,
        tenant_id=principal.tenant_id,
        tier=principal.tier,
        weight=principal.weight,
        content_retention_days=principal.content_retention_days,
        model=deployment.model_id,
        version=deployment.version,
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
