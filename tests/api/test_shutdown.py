"""The API's drain on SIGTERM (`api/shutdown.py`), driven without a signal: new listeners
refused at once, open streams left their grace, then interrupted, and a second signal
skipping the rest of the grace. Against a real redis-server."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from api.broker import Interruption
from api.shutdown import Shutdown
from api.subscriber import Notice, Subscriber, SubscriberClosed


async def _subscriber(aredis) -> Subscriber:
    subscriber = Subscriber(aredis, 1, max_num_buffered=8)
    subscriber.start()
    return subscriber


async def test_open_streams_get_their_grace_then_are_interrupted(aredis):
    subscriber = await _subscriber(aredis)
    try:
        inbox = await subscriber.listen(f"test-shutdown:{uuid.uuid4().hex}")
        shutdown = Shutdown(grace_s=0.5, subscriber=subscriber)
        shutdown.begin()
        assert shutdown.is_draining
        with pytest.raises(SubscriberClosed):
            await subscriber.listen("test-shutdown:late")
        # Within the grace: nothing for the stream.
        assert await inbox.get(0.2) is None
        assert await inbox.get(2) is Notice.INTERRUPTED
        assert inbox.interruption == Interruption.API_SHUTDOWN
        subscriber.stop_listening(inbox)
    finally:
        await subscriber.aclose()


async def test_a_second_signal_skips_the_rest_of_the_grace(aredis):
    subscriber = await _subscriber(aredis)
    try:
        inbox = await subscriber.listen(f"test-shutdown:{uuid.uuid4().hex}")
        shutdown = Shutdown(grace_s=60, subscriber=subscriber)
        shutdown.begin()
        await asyncio.sleep(0.2)
        shutdown.begin()
        assert await inbox.get(5) is Notice.INTERRUPTED
        subscriber.stop_listening(inbox)
    finally:
        await subscriber.aclose()


async def test_with_no_stream_open_the_drain_ends_at_once(aredis):
    subscriber = await _subscriber(aredis)
    try:
        shutdown = Shutdown(grace_s=60, subscriber=subscriber)
        shutdown.begin()
        assert shutdown._drain is not None
        await asyncio.wait_for(shutdown._drain, 2)
    finally:
        await subscriber.aclose()
