"""The API's shared subscriber (`api/subscriber.py`) against a real redis-server: many
listeners over a few connections, subscriptions confirmed before `listen` returns, bounded
inboxes, and a killed connection opened again and repaired from the journal, every stream
still whole and in order."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from api import broker
from api.subscriber import CLIENT_NAME, Inbox, Notice, Subscriber
from shared import keys
from shared.journal import Journal
from shared.protocol import FinalEvent, TokenEvent, Usage, encode_event

NUM_CONNECTIONS = 2


@pytest.fixture
async def subscriber(aredis):
    subscriber = Subscriber(aredis, NUM_CONNECTIONS, max_num_buffered=64)
    subscriber.start()
    yield subscriber
    await subscriber.aclose()


def _channel() -> str:
    return f"test-subscriber:{uuid.uuid4().hex}"


async def _subscriber_clients(aredis) -> list[dict]:
    name = f"{CLIENT_NAME}-{os.getpid()}"
    return [c for c in await aredis.client_list() if c.get("name") == name]


async def _numsub(aredis, channel: str) -> int:
    [(_, count)] = await aredis.pubsub_numsub(channel)
    return count


async def _next(inbox: Inbox, timeout_s: float = 5.0) -> bytes | Notice | None:
    return await inbox.get(timeout_s)


async def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


async def test_many_listeners_share_few_connections_and_each_is_subscribed_on_return(
    subscriber, aredis
):
    channels = [_channel() for _ in range(300)]
    inboxes = await asyncio.gather(*(subscriber.listen(c) for c in channels))
    # Three more listeners on the first channel share its subscription.
    shared = await asyncio.gather(*(subscriber.listen(channels[0]) for _ in range(3)))
    assert len(await _subscriber_clients(aredis)) == NUM_CONNECTIONS
    assert subscriber.num_listeners == 303
    # Subscribed when `listen` returned: a PUBLISH straight after reaches it.
    for channel in channels:
        assert await aredis.publish(channel, channel) == 1
    for channel, inbox in zip(channels, inboxes, strict=True):
        assert await _next(inbox) == channel.encode()
    for inbox in shared:
        assert await _next(inbox) == channels[0].encode()
    for inbox in [*inboxes, *shared]:
        subscriber.stop_listening(inbox)
    assert subscriber.num_listeners == 0


async def test_messages_keep_their_order(subscriber, aredis):
    channel = _channel()
    inbox = await subscriber.listen(channel)
    for i in range(50):
        await aredis.publish(channel, str(i))
    assert [await _next(inbox) for _ in range(50)] == [str(i).encode() for i in range(50)]
    subscriber.stop_listening(inbox)


async def test_the_last_listener_unsubscribes_and_a_new_one_subscribes_again(subscriber, aredis):
    channel = _channel()
    first = await subscriber.listen(channel)
    subscriber.stop_listening(first)
    # At once, while the UNSUBSCRIBE may still be on its way.
    second = await subscriber.listen(channel)
    assert await aredis.publish(channel, "x") == 1
    assert await _next(second) == b"x"
    assert await _numsub(aredis, channel) == 1
    subscriber.stop_listening(second)

    async def is_unsubscribed() -> bool:
        return await _numsub(aredis, channel) == 0

    await _wait_until(is_unsubscribed, 5, "the channel stayed subscribed")


async def test_a_full_inbox_drops_what_comes_and_says_it_missed_it(aredis):
    subscriber = Subscriber(aredis, 1, max_num_buffered=16)
    subscriber.start()
    try:
        slow, other = _channel(), _channel()
        slow_inbox = await subscriber.listen(slow)
        other_inbox = await subscriber.listen(other)  # the same connection, read as it comes

        async def read_other() -> list:
            return [await _next(other_inbox) for _ in range(100)]

        reading = asyncio.create_task(read_other())
        for i in range(100):
            await aredis.publish(slow, str(i))
            await aredis.publish(other, str(i))
            assert slow_inbox.num_held <= 16
        # The other listener got all of its messages, in order, none dropped.
        assert await asyncio.wait_for(reading, 10) == [str(i).encode() for i in range(100)]
        assert await _next(slow_inbox) is Notice.MISSED
    finally:
        await subscriber.aclose()


async def test_an_interrupted_listener_is_told_at_once(subscriber):
    inbox = await subscriber.listen(_channel())
    waiting = asyncio.create_task(inbox.get(30))
    await asyncio.sleep(0.05)
    subscriber.interrupt_all("api_shutdown")
    assert await asyncio.wait_for(waiting, 5) is Notice.INTERRUPTED
    assert inbox.interruption == "api_shutdown"
    subscriber.stop_listening(inbox)


async def test_a_killed_connection_is_opened_again_and_its_listeners_told_they_missed(
    subscriber, aredis
):
    channels = [_channel() for _ in range(20)]
    inboxes = [await subscriber.listen(c) for c in channels]
    killed = await _kill_subscriber_connections(aredis)
    assert killed == NUM_CONNECTIONS

    async def is_resubscribed() -> bool:
        counts = [await _numsub(aredis, c) for c in channels]
        return counts == [1] * len(channels)

    await _wait_until(is_resubscribed, 10, "not subscribed again")
    for inbox in inboxes:
        assert await _next(inbox) is Notice.MISSED
    assert len(await _subscriber_clients(aredis)) == NUM_CONNECTIONS
    for channel, inbox in zip(channels, inboxes, strict=True):
        await aredis.publish(channel, "after")
        assert await _next(inbox) == b"after"
        subscriber.stop_listening(inbox)


async def _kill_subscriber_connections(aredis) -> int:
    clients = await _subscriber_clients(aredis)
    for client in clients:
        await aredis.execute_command("CLIENT", "KILL", "ID", client["id"])
    return len(clients)


# Through the streams that read them (`api/broker.py`).


def _token(seq: int) -> TokenEvent:
    return TokenEvent(seq=seq, text=f"<{seq}>", num_tokens=1)


def _final() -> FinalEvent:
    return FinalEvent(
        seq=0, text="", finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1)
    )


async def test_every_stream_ends_whole_and_in_order_after_its_connection_is_killed(
    subscriber, aredis
):
    """Forty streams over two connections. Half their events come live; the rest reach
    the journal while their PUBLISH is lost, and then the connections are killed: the
    streams get them from the journal once their channels are subscribed again. The idle
    check is far away (60 s), so only that repair can end them within the test's 20 s."""
    journal = Journal(aredis, ttl_s=60)
    timing = broker.StreamTiming(idle_check_s=60, lost_after_s=60)
    streams = broker.Broker(aredis, journal, subscriber, timing)
    request_ids = [uuid.uuid4().hex for _ in range(40)]
    infos = [broker.RequestInfo(rid, "tenant", "model", "completion", 0) for rid in request_ids]
    subscriptions = [await streams.resume(info, 0) for info in infos]
    readers = [asyncio.create_task(_read_all(s)) for s in subscriptions]
    for seq in range(10):
        for rid in request_ids:
            assert await journal.append(rid, _token(seq))
    for rid in request_ids:  # appended, never published
        for seq in range(10, 20):
            event = encode_event(_token(seq))
            await aredis.xadd(keys.request_events(rid), {"e": event}, id=f"0-{seq + 1}")
        final = encode_event(_final().model_copy(update={"seq": 20}))
        await aredis.xadd(keys.request_events(rid), {"e": final}, id="0-21")
    assert await _kill_subscriber_connections(aredis) == NUM_CONNECTIONS
    results = await asyncio.wait_for(asyncio.gather(*readers), 20)
    for events in results:
        assert [(e.type, e.seq) for e in events] == [("token", s) for s in range(20)] + [
            ("final", 20)
        ]
    for subscription in subscriptions:
        await subscription.close(cancel_if_unfinished=False)


async def _read_all(subscription: broker.Subscription) -> list:
    return [event async for event in subscription.events()]
