"""The autoscaler's arrival signal as the API's enqueue writes it, against a real
redis-server (`shared/arrivals.py`)."""

from __future__ import annotations

import time
import uuid

from api import broker
from api.subscriber import Subscriber
from shared import arrivals, keys
from shared.journal import Journal
from tests.factories import make_request


async def _submit_all(aredis, requests) -> None:
    journal = Journal(aredis, ttl_s=60)
    subscriber = Subscriber(aredis, num_connections=1, max_num_buffered=64)
    subscriber.start()
    timing = broker.StreamTiming(idle_check_s=5.0, lost_after_s=6.0)
    try:
        for request in requests:
            subscription = await broker.Broker(aredis, journal, subscriber, timing).submit(request)
            await subscription.close(cancel_if_unfinished=False)
    finally:
        await subscriber.aclose()


async def test_each_enqueued_request_is_counted_once_with_its_prompt_tokens(aredis):
    model = f"m-{uuid.uuid4().hex[:8]}"
    requests = [
        make_request(i, [1] * (i + 1), 4).model_copy(
            update={"request_id": uuid.uuid4().hex, "model": model}
        )
        for i in range(5)
    ]
    started_s = time.time()
    # The last one twice: a retried enqueue (the client's connection broke) counts nothing.
    await _submit_all(aredis, [*requests, requests[-1]])
    name = requests[0].deployment_name
    # Read as of the bucket after the one written, over a window that covers both buckets
    # a slow submit may have straddled.
    later_s = time.time() + keys.ARRIVAL_BUCKET_S
    window_s = 2 * keys.ARRIVAL_BUCKET_S + (later_s - started_s)
    rates = await arrivals.read_rates(aredis, name, later_s, window_s)
    span_s = -(-window_s // keys.ARRIVAL_BUCKET_S) * keys.ARRIVAL_BUCKET_S
    assert round(rates.requests_per_s * span_s) == 5
    assert round(rates.prompt_tokens_per_s * span_s) == 1 + 2 + 3 + 4 + 5
    key = arrivals.bucket_key(name, started_s)
    assert 0 < await aredis.ttl(key) <= arrivals.BUCKET_TTL_S


async def test_rates_are_over_whole_buckets_without_the_one_still_filling(aredis):
    name = f"m-{uuid.uuid4().hex[:8]}@1"
    now_s = 1_000_000.0 + 2.0  # 2 s into a bucket
    current = arrivals.bucket_start_s(now_s)
    step = keys.ARRIVAL_BUCKET_S
    for start, num_requests in [(current, 100), (current - step, 10), (current - 2 * step, 20)]:
        await aredis.hset(
            keys.arrivals(name, start),
            mapping={"requests": num_requests, "prompt_tokens": 7 * num_requests},
        )
    rates = await arrivals.read_rates(aredis, name, now_s, 2 * step)
    assert rates.requests_per_s == (10 + 20) / (2 * step)  # not the 100 still filling
    assert rates.prompt_tokens_per_s == 7 * (10 + 20) / (2 * step)
