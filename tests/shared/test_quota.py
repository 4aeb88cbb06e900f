"""The admission scripts against a real redis-server: all-or-nothing, leaked slots expire,
buckets refill and settle back without overflowing.

Time is Redis's own clock, so refill is tested with fast limits and short waits.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from shared import keys, quota
from shared.tenants import TenantLimits
from tests.factories import make_request

LIFETIME_S = 3600.0


@pytest.fixture
def tenant_id(rdb) -> str:
    tenant_id = f"quota-{uuid.uuid4().hex[:8]}"
    yield tenant_id
    rdb.delete(
        keys.tenant_inflight(tenant_id),
        keys.tenant_queued(tenant_id),
        keys.tenant_buckets(tenant_id),
    )


def _request(tenant_id: str, i: int, num_prompt_tokens: int = 1, max_tokens: int = 1):
    return make_request(i, list(range(num_prompt_tokens)), max_tokens, tenant_id=tenant_id)


async def _admit(aredis, tenant_id, i, limits, lifetime_s=LIFETIME_S, **sizes):
    return await quota.admit(aredis, limits, _request(tenant_id, i, **sizes), lifetime_s)


def _members(rdb, key: str) -> set[str]:
    return {m.decode() for m in rdb.zrange(key, 0, -1)}


def _level(rdb, tenant_id: str, bucket: str) -> float:
    return float(rdb.hget(keys.tenant_buckets(tenant_id), f"{bucket}:level"))


async def test_without_limits_every_request_is_admitted_and_tracked(aredis, rdb, tenant_id):
    for i in range(3):
        assert await _admit(aredis, tenant_id, i, TenantLimits()) is None
    assert _members(rdb, keys.tenant_inflight(tenant_id)) == {"r0", "r1", "r2"}
    assert _members(rdb, keys.tenant_queued(tenant_id)) == {"r0", "r1", "r2"}
    assert not rdb.exists(keys.tenant_buckets(tenant_id))
    # The sets expire with their last member, so an idle tenant leaves nothing behind.
    assert 0 < rdb.pttl(keys.tenant_inflight(tenant_id)) <= LIFETIME_S * 1000 + 1


async def test_in_flight_limit_refuses_with_a_one_second_retry(aredis, rdb, tenant_id):
    limits = TenantLimits(max_requests_in_flight=2)
    assert await _admit(aredis, tenant_id, 0, limits) is None
    assert await _admit(aredis, tenant_id, 1, limits) is None
    refusal = await _admit(aredis, tenant_id, 2, limits)
    assert refusal == quota.Refusal("requests_in_flight", allowed=2, retry_after_s=1)
    assert refusal.code == "requests_in_flight_exceeded"
    assert _members(rdb, keys.tenant_inflight(tenant_id)) == {"r0", "r1"}


async def test_queued_limit_counts_only_requests_no_worker_pulled(aredis, rdb, tenant_id):
    limits = TenantLimits(max_requests_queued=1)
    assert await _admit(aredis, tenant_id, 0, limits) is None
    assert (await _admit(aredis, tenant_id, 1, limits)).limit == "requests_queued"
    await quota.mark_started(aredis, _request(tenant_id, 0))
    assert await _admit(aredis, tenant_id, 1, limits) is None
    assert _members(rdb, keys.tenant_queued(tenant_id)) == {"r1"}
    assert _members(rdb, keys.tenant_inflight(tenant_id)) == {"r0", "r1"}


async def test_a_refused_request_takes_nothing_from_the_limits_that_passed(aredis, rdb, tenant_id):
    limits = TenantLimits(requests_per_minute=10, tokens_per_minute=100)
    assert await _admit(aredis, tenant_id, 0, limits, num_prompt_tokens=40, max_tokens=40) is None
    before = rdb.hgetall(keys.tenant_buckets(tenant_id))
    # The request bucket would pass; the token bucket (about 20 left) does not.
    refusal = await _admit(aredis, tenant_id, 1, limits, num_prompt_tokens=20, max_tokens=20)
    assert refusal.limit == "tokens_per_minute"
    assert rdb.hgetall(keys.tenant_buckets(tenant_id)) == before
    assert _members(rdb, keys.tenant_inflight(tenant_id)) == {"r0"}
    assert _members(rdb, keys.tenant_queued(tenant_id)) == {"r0"}


async def test_the_first_failing_limit_is_reported(aredis, tenant_id):
    limits = TenantLimits(max_requests_in_flight=1, max_requests_queued=1, tokens_per_minute=10)
    assert await _admit(aredis, tenant_id, 0, limits, max_tokens=9) is None
    # Every limit is now exhausted; in flight is checked first.
    assert (await _admit(aredis, tenant_id, 1, limits)).limit == "requests_in_flight"


async def test_leaked_slots_expire(aredis, rdb, tenant_id):
    limits = TenantLimits(max_requests_in_flight=1)
    assert await _admit(aredis, tenant_id, 0, limits, lifetime_s=0.2) is None
    assert (await _admit(aredis, tenant_id, 1, limits, lifetime_s=0.2)) is not None
    await asyncio.sleep(0.3)  # r0's API and worker never settle it: it has leaked
    assert await _admit(aredis, tenant_id, 2, limits, lifetime_s=0.2) is None
    assert _members(rdb, keys.tenant_inflight(tenant_id)) == {"r2"}


async def test_requests_per_minute_bucket_refills(aredis, tenant_id):
    limits = TenantLimits(requests_per_minute=120)  # 2 a second
    for i in range(120):
        assert await _admit(aredis, tenant_id, i, limits) is None
    refusal = await _admit(aredis, tenant_id, 120, limits)
    assert refusal == quota.Refusal("requests_per_minute", allowed=120, retry_after_s=1)
    await asyncio.sleep(0.6)
    assert await _admit(aredis, tenant_id, 120, limits) is None


async def test_tokens_per_minute_retry_after_is_the_time_to_refill(aredis, tenant_id):
    limits = TenantLimits(tokens_per_minute=6000)  # 100 a second
    assert await _admit(aredis, tenant_id, 0, limits, num_prompt_tokens=1, max_tokens=5999) is None
    refusal = await _admit(aredis, tenant_id, 1, limits, num_prompt_tokens=1, max_tokens=2999)
    assert refusal.limit == "tokens_per_minute"
    assert 29 <= refusal.retry_after_s <= 30
    await asyncio.sleep(0.2)
    assert await _admit(aredis, tenant_id, 1, limits, num_prompt_tokens=1, max_tokens=9) is None


async def test_a_zero_limit_refuses_with_a_minute_retry(aredis, tenant_id):
    refusal = await _admit(aredis, tenant_id, 0, TenantLimits(requests_per_minute=0))
    assert refusal == quota.Refusal("requests_per_minute", allowed=0, retry_after_s=60)


async def test_settle_frees_the_slots_and_refunds_the_unused_tokens_once(aredis, rdb, tenant_id):
    limits = TenantLimits(tokens_per_minute=1000)
    request = _request(tenant_id, 0, num_prompt_tokens=100, max_tokens=500)
    assert await quota.admit(aredis, limits, request, LIFETIME_S) is None
    assert _level(rdb, tenant_id, "tpm") == pytest.approx(400, abs=1)
    # 100 prompt + 50 output tokens used: 450 of the 600 reserved go back.
    assert await quota.settle(aredis, request, num_used_tokens=150) is True
    assert _level(rdb, tenant_id, "tpm") == pytest.approx(850, abs=2)
    assert not rdb.exists(keys.tenant_inflight(tenant_id), keys.tenant_queued(tenant_id))
    # A second settle (a redelivered entry) gives nothing back twice.
    assert await quota.settle(aredis, request, num_used_tokens=150) is False
    assert _level(rdb, tenant_id, "tpm") == pytest.approx(850, abs=2)


async def test_settle_never_fills_a_bucket_above_its_capacity(aredis, rdb, tenant_id):
    limits = TenantLimits(tokens_per_minute=1000)
    request = _request(tenant_id, 0, num_prompt_tokens=10, max_tokens=90)
    assert await quota.admit(aredis, limits, request, LIFETIME_S) is None
    await asyncio.sleep(0.2)  # refills 3 of the 100 taken before the refund of all 100
    assert await quota.settle(aredis, request, num_used_tokens=0) is True
    assert _level(rdb, tenant_id, "tpm") == 1000


async def test_release_gives_back_the_request_and_its_tokens(aredis, rdb, tenant_id):
    limits = TenantLimits(requests_per_minute=1, tokens_per_minute=100)
    request = _request(tenant_id, 0, num_prompt_tokens=50, max_tokens=50)
    assert await quota.admit(aredis, limits, request, LIFETIME_S) is None
    assert (await _admit(aredis, tenant_id, 1, limits)).limit == "requests_per_minute"
    assert await quota.release(aredis, request) is True
    assert _level(rdb, tenant_id, "rpm") == 1
    assert _level(rdb, tenant_id, "tpm") == 100
    assert await _admit(aredis, tenant_id, 1, limits) is None


async def test_without_a_tokens_limit_taking_the_tokens_costs_no_call(own_redis, tenant_id):
    # The admission path's second script only takes tokens: without a tokens-per-minute limit
    # it has nothing to take, and costs every request a round trip to Redis for nothing.
    client = aioredis.Redis.from_url(own_redis.url)
    try:
        request = make_request(0, [1, 2, 3], 8, tenant_id=tenant_id)
        assert await quota.admit_request(client, TenantLimits(), tenant_id, "r", 60) is None
        await client.config_resetstat()
        assert await quota.admit_tokens(client, TenantLimits(), request, 60) is None
        stats = await client.info("commandstats")
        assert not any(name.startswith("cmdstat_eval") for name in stats), stats
        limited = TenantLimits(tokens_per_minute=5)
        refusal = await quota.admit_tokens(client, limited, request, 60)
        assert refusal is not None and refusal.limit == "tokens_per_minute"
    finally:
        await client.aclose()
