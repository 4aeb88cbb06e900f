"""The request journal and the API's reading of it, against a real redis-server: ordered,
gap-free event streams whatever pub/sub drops, and exactly one end."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from api import broker
from api.subscriber import Subscriber
from shared import keys
from shared.journal import Journal
from shared.protocol import ErrorEvent, FinalEvent, TokenEvent, Usage, encode_event
from tests.factories import make_request


@pytest.fixture
def journal(aredis) -> Journal:
    return Journal(aredis, ttl_s=60)


@pytest.fixture
async def subscriber(aredis):
    subscriber = Subscriber(aredis, num_connections=2, max_num_buffered=64)
    subscriber.start()
    yield subscriber
    await subscriber.aclose()


def _broker(aredis, journal, subscriber, idle_check_s: float = 0.2) -> broker.Broker:
    timing = broker.StreamTiming(idle_check_s=idle_check_s, lost_after_s=6.0)
    return broker.Broker(aredis, journal, subscriber, timing)


def _token(seq: int, text: str = "x") -> TokenEvent:
    return TokenEvent(seq=seq, text=text, num_tokens=1)


def _final() -> FinalEvent:
    return FinalEvent(
        seq=0, text="", finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=2)
    )


async def test_events_are_kept_in_order_and_a_seq_is_written_once(journal, aredis):
    rid = uuid.uuid4().hex
    assert await journal.append(rid, _token(0, "a"))
    assert await journal.append(rid, _token(1, "b"))
    assert not await journal.append(rid, _token(1, "again"))  # a second writer of seq 1
    assert [e.text for e in await journal.read_after(rid, -1)] == ["a", "b"]
    assert [e.text for e in await journal.read_after(rid, 0)] == ["b"]
    assert await journal.last_seq(rid) == 1
    assert 0 < await aredis.ttl(keys.request_events(rid)) <= 60


async def test_one_end_and_nothing_after_it(journal):
    rid = uuid.uuid4().hex
    await journal.append(rid, _token(0))
    assert await journal.claim_end(rid, "worker-1")
    assert not await journal.claim_end(rid, "api-7")  # the second to notice does nothing
    assert not await journal.append(rid, _token(1))  # the end is claimed: no more tokens
    assert not await journal.append_end(
        rid, "api-7", ErrorEvent(seq=0, code="worker_lost", message="m")
    )
    assert await journal.append_end(rid, "worker-1", _final())
    events = await journal.read_after(rid, -1)
    assert [(e.type, e.seq) for e in events] == [("token", 0), ("final", 1)]
    assert await journal.is_done(rid)


async def _subscription(aredis, journal, subscriber, rid: str):
    info = broker.RequestInfo(rid, "tenant", "model", "completion", 0)
    return await _broker(aredis, journal, subscriber).resume(info, 0)


async def _collect(subscription) -> list:
    async def run():
        return [e async for e in subscription.events()]

    try:
        return await asyncio.wait_for(run(), timeout=10)
    finally:
        await subscription.close(cancel_if_unfinished=False)


async def test_a_reader_fills_what_pub_sub_dropped_from_the_journal(journal, aredis, subscriber):
    rid = uuid.uuid4().hex
    subscription = await _subscription(aredis, journal, subscriber, rid)
    # Events 0 and 1 reach the journal but their PUBLISH is lost; 2 arrives by pub/sub.
    for seq in (0, 1):
        event = encode_event(_token(seq, str(seq)))
        await aredis.xadd(keys.request_events(rid), {"e": event}, id=f"0-{seq + 1}")
    assert await journal.append(rid, _token(2, "2"))
    assert await journal.claim_end(rid, "w")
    assert await journal.append_end(rid, "w", _final())
    events = await _collect(subscription)
    assert [(e.type, e.seq) for e in events] == [
        ("token", 0),
        ("token", 1),
        ("token", 2),
        ("final", 3),
    ]


async def test_a_reader_finds_an_end_that_was_never_published(journal, aredis, subscriber):
    rid = uuid.uuid4().hex
    subscription = await _subscription(aredis, journal, subscriber, rid)
    assert await journal.append(rid, _token(0))
    # The final event is in the journal, but its PUBLISH never came (a paused subscriber).
    event = encode_event(_final().model_copy(update={"seq": 1}))
    await aredis.xadd(keys.request_events(rid), {"e": event}, id="0-2")
    events = await _collect(subscription)
    assert [(e.type, e.seq) for e in events] == [("token", 0), ("final", 1)]


async def test_a_resumed_reader_starts_after_the_last_event_it_saw(journal, aredis, subscriber):
    rid = uuid.uuid4().hex
    for seq in range(3):
        await journal.append(rid, _token(seq, str(seq)))
    subscription = await _subscription(aredis, journal, subscriber, rid)
    subscription.next_seq = 2
    await journal.claim_end(rid, "w")
    await journal.append_end(rid, "w", _final())
    events = await _collect(subscription)
    assert [(e.type, e.seq) for e in events] == [("token", 2), ("final", 3)]


async def test_a_retried_call_is_not_taken_for_a_refusal(journal):
    # The Redis client retries a command whose connection broke, possibly after it ran.
    rid = uuid.uuid4().hex
    token = _token(0, "a")
    assert await journal.append(rid, token)
    assert await journal.append(rid, token)  # the same event again: fine
    assert not await journal.append(rid, _token(0, "b"))  # another writer's seq 0: refused
    assert await journal.claim_end(rid, "w")
    assert await journal.claim_end(rid, "w")  # the same claimer again: still its end
    assert await journal.append_end(rid, "w", _final())
    assert await journal.append_end(rid, "w", _final())  # no second final
    events = await journal.read_after(rid, -1)
    assert [(e.type, e.seq) for e in events] == [("token", 0), ("final", 1)]


async def test_a_retried_enqueue_queues_the_request_once(journal, aredis, subscriber):
    # A retry of a submit whose first call ran (a broken connection) must not enqueue twice:
    # the second entry would be served, or acknowledged, as a separate delivery.
    request = make_request(0, [1, 2, 3], 4, tenant_id=f"t-{uuid.uuid4().hex[:8]}")
    request = request.model_copy(update={"request_id": uuid.uuid4().hex})
    first = await _broker(aredis, journal, subscriber).submit(request)
    second = await _broker(aredis, journal, subscriber).submit(request)
    await first.close(cancel_if_unfinished=False)
    await second.close(cancel_if_unfinished=False)
    stream = keys.tenant_stream(request.deployment_name, request.tenant_id)
    entries = await aredis.xrange(stream)
    assert len(entries) == 1
    meta = await journal.meta(request.request_id)
    assert meta["entry_id"] == entries[0][0].decode()
    assert meta["stream"] == stream and meta["num_input_tokens"] == "3"
    assert request.tenant_id.encode() in await aredis.smembers(
        keys.model_tenants(request.deployment_name)
    )
    assert 0 < await aredis.ttl(keys.request_meta(request.request_id)) <= 60


class _CountingJournal(Journal):
    """The journal, counting the reads a stream makes of it."""

    num_reads = 0

    async def read_after(self, request_id, after_seq):
        self.num_reads += 1
        return await super().read_after(request_id, after_seq)


async def _num_reads_while_silent(aredis, subscriber, *, has_started: bool, silent_s: float):
    journal = _CountingJournal(aredis, ttl_s=60)
    request = make_request(0, [1, 2, 3], 4, tenant_id=f"t-{uuid.uuid4().hex[:8]}")
    request = request.model_copy(update={"request_id": uuid.uuid4().hex})
    subscription = await _broker(aredis, journal, subscriber).submit(request)
    if has_started:
        assert await journal.append(request.request_id, _token(0))
    reading = asyncio.ensure_future(anext(aiter(subscription.events())))
    if has_started:
        assert (await asyncio.wait_for(reading, timeout=5)).seq == 0
        reading = asyncio.ensure_future(anext(aiter(subscription.events())))
    journal.num_reads = 0
    await asyncio.sleep(silent_s)
    reading.cancel()
    await subscription.close(cancel_if_unfinished=False)
    return journal.num_reads


async def test_a_queued_silent_stream_checks_less_and_less_often(aredis, subscriber):
    # idle_check_s 0.2: checks after 0.2, 0.4, 0.8, 1.6 s of silence (about 3 s), where one
    # check every 0.2 s would be 15, two reads of the journal each before.
    num_reads = await _num_reads_while_silent(aredis, subscriber, has_started=False, silent_s=3)
    assert 2 <= num_reads <= 6


async def test_a_started_silent_stream_keeps_checking_every_idle_check(aredis, subscriber):
    # Started: its worker may be dead, which the checks must find within the heartbeat timeout.
    num_reads = await _num_reads_while_silent(aredis, subscriber, has_started=True, silent_s=3)
    assert num_reads >= 12


async def test_a_queued_stream_ends_at_its_queue_deadline_with_no_worker(
    journal, aredis, subscriber
):
    request = make_request(0, [1, 2, 3], 4, tenant_id=f"t-{uuid.uuid4().hex[:8]}")
    request = request.model_copy(
        update={"request_id": uuid.uuid4().hex, "queue_deadline_ts": time.time() + 1.0}
    )
    subscription = await _broker(aredis, journal, subscriber).submit(request)
    events = await _collect(subscription)
    assert [(e.type, e.code) for e in events] == [("error", "queue_timeout")]


async def test_a_fresh_stream_reads_no_journal_before_its_first_event(aredis, subscriber):
    # Subscribed before its request was enqueued: its events come over pub/sub, and a read
    # of the (empty) journal first would be a round trip to Redis per request for nothing.
    journal = _CountingJournal(aredis, ttl_s=60)
    request = make_request(0, [1, 2, 3], 4, tenant_id=f"t-{uuid.uuid4().hex[:8]}")
    request = request.model_copy(update={"request_id": uuid.uuid4().hex})
    subscription = await _broker(aredis, journal, subscriber, idle_check_s=30).submit(request)
    reading = asyncio.ensure_future(anext(aiter(subscription.events())))
    await asyncio.sleep(0.1)
    assert await journal.append(request.request_id, _token(0, "a"))  # appends and publishes
    first = await asyncio.wait_for(reading, timeout=5)
    await subscription.close(cancel_if_unfinished=False)
    assert (first.seq, first.text) == (0, "a")
    assert journal.num_reads == 0


async def test_keepalives_come_while_silent_and_the_silence_checks_keep_their_time(
    aredis, subscriber
):
    # Keepalives every 0.1 s, silence checks every 0.2 s (started: they do not back off). A
    # keepalive's wake-up must not restart the check's wait, or no check would ever come.
    journal = _CountingJournal(aredis, ttl_s=60)
    request = make_request(0, [1, 2, 3], 4, tenant_id=f"t-{uuid.uuid4().hex[:8]}")
    request = request.model_copy(update={"request_id": uuid.uuid4().hex})
    subscription = await _broker(aredis, journal, subscriber, idle_check_s=0.2).submit(request)
    assert await journal.append(request.request_id, _token(0))
    items = []

    async def read() -> None:
        async for item in subscription.events(keepalive_s=0.1):
            items.append(item)

    reading = asyncio.ensure_future(read())
    await asyncio.sleep(1.5)
    reading.cancel()
    await subscription.close(cancel_if_unfinished=False)
    assert items[0] == _token(0)
    num_keepalives = sum(item is broker.KEEPALIVE for item in items)
    assert 8 <= num_keepalives <= 16
    assert journal.num_reads >= 4
