"""One API process's pub/sub: the request channels of all its streams, multiplexed over a few
shared Redis connections (`LLMFLEET_API_NUM_SUBSCRIBER_CONNECTIONS`).

A stream `listen`s to its request's channel: SUBSCRIBE goes out on one of the shared
connections (picked by the channel's hash, so the listeners of one channel share one
subscription), and `listen` returns once Redis has confirmed it, so that whatever is
published from then on is heard: the hand-off's safety (`api/broker.py`) rests on that.

One reader task per connection reads everything Redis sends on it and puts each message
into the inbox of every listener of its channel, never waiting on a stream. An inbox holds
at most `max_num_buffered` messages; one more is dropped and the inbox notes that it missed
some (`Notice.MISSED`), and its stream reads them from the request's journal. So a stream
whose client reads slowly costs bounded memory and holds up no other stream, and the reader
takes what Redis sends as fast as it comes, so `client-output-buffer-limit pubsub` never cuts
a shared connection because of one slow stream.

A connection that drops (a broker restart, `CLIENT KILL`, a PING left unanswered) is opened
again with backoff and subscribes again to every channel it carried; once that is confirmed,
each of their inboxes notes that it missed messages, so every stream on it repairs from the
journal, as after a gap.

Not redis-py's `PubSub`: it reconnects and resubscribes inside its reads by itself, so a
stream could not know to repair, and it matches no confirmation to the SUBSCRIBE that asked
for it. Here each connection is a plain redis-py `Connection`, read by one task only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import zlib
from collections import deque
from collections.abc import Callable
from enum import Enum

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.redis_conn import BROKER_ERRORS

log = logging.getLogger("llmfleet.api")

# The Redis client name of the shared connections, followed by `-<pid>` (`CLIENT LIST`
# tells them and their process apart).
CLIENT_NAME = "llmfleet-api-subscriber"
SUBSCRIBE_TIMEOUT_S = 5.0
# A connection silent this long is sent a PING; silent as long again, it is taken for dead
# (a connection cut without a reset would otherwise be read forever).
PING_INTERVAL_S = 10.0
MIN_RECONNECT_DELAY_S = 0.05
MAX_RECONNECT_DELAY_S = 2.0

_SUBSCRIBE = b"subscribe"
_UNSUBSCRIBE = b"unsubscribe"
_MESSAGE = b"message"


class SubscriberClosed(Exception):
    """The subscriber takes no new listeners: the process is shutting down."""


class Notice(Enum):
    """What an inbox hands out instead of a message."""

    MISSED = "missed"  # messages were dropped: what they held must be read elsewhere
    INTERRUPTED = "interrupted"  # the listener is to stop (`Inbox.interruption` says why)


class Inbox:
    """A listener's messages from its channel, in the order Redis sent them; at most
    `max_num_messages` held."""

    def __init__(self, channel: bytes, max_num_messages: int) -> None:
        self.channel = channel
        self.interruption: str | None = None
        self._max_num_messages = max_num_messages
        self._messages: deque[bytes] = deque()
        self._has_missed = False
        self._arrived = asyncio.Event()

    @property
    def num_held(self) -> int:
        return len(self._messages)

    def put(self, data: bytes) -> None:
        if len(self._messages) >= self._max_num_messages:
            self.mark_missed()
            return
        self._messages.append(data)
        self._arrived.set()

    def mark_missed(self) -> None:
        # What is held goes too: the journal read that the notice asks for covers it.
        self._messages.clear()
        self._has_missed = True
        self._arrived.set()

    def interrupt(self, reason: str) -> None:
        """Make the listener stop at its next `get` (the first reason given stays)."""
        if self.interruption is None:
            self.interruption = reason
        self._arrived.set()

    async def get(self, timeout_s: float) -> bytes | Notice | None:
        """The next message or notice; None after `timeout_s` without either."""
        if not self._is_ready():
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._arrived.wait()
        if self.interruption is not None:
            return Notice.INTERRUPTED
        if self._has_missed:
            self._has_missed = False
            return Notice.MISSED
        return self._messages.popleft() if self._messages else None

    def _is_ready(self) -> bool:
        return bool(self._messages) or self._has_missed or self.interruption is not None


class _SharedConnection:
    """One pub/sub connection and the listeners of the channels it carries.

    Per channel it keeps the SUBSCRIBEs and UNSUBSCRIBEs sent and not yet answered, in the
    order sent (Redis answers in that order): a channel is live, and its waiting listeners
    are told so, when the answer to the last one sent is a subscribe. Commands are written
    one at a time under `_lock`, their bookkeeping with them, so it follows the wire; the
    channels asked for (or given up) in one turn of the event loop share one command."""

    def __init__(self, make_connection: Callable[[], AbstractConnection]) -> None:
        self._make_connection = make_connection
        self._connection: AbstractConnection | None = None
        self._lock = asyncio.Lock()
        self.listeners: dict[bytes, set[Inbox]] = {}
        self._in_flight: dict[bytes, deque[bytes]] = {}
        self._live: set[bytes] = set()
        self._waiters: dict[bytes, list[asyncio.Future[None]]] = {}
        # Channels that had listeners when a connection dropped: once subscribed again, their
        # inboxes are told that they missed what came meanwhile.
        self._to_repair: set[bytes] = set()
        self._to_subscribe: set[bytes] = set()
        self._subscribing: asyncio.Task | None = None
        self._to_unsubscribe: set[bytes] = set()
        self._unsubscribing: asyncio.Task | None = None

    async def run(self) -> None:
        """Read the connection, and open it again whenever it drops, with backoff."""
        delay_s = MIN_RECONNECT_DELAY_S
        while True:
            connection = self._make_connection()
            try:
                await self._open(connection)
                delay_s = MIN_RECONNECT_DELAY_S
                await self._read(connection)
            except BROKER_ERRORS as exc:
                log.warning("pub/sub connection lost (%s); opening it again", exc)
            finally:
                self._forget(connection)
                await connection.disconnect(nowait=True)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, MAX_RECONNECT_DELAY_S)

    async def join(self, inbox: Inbox) -> None:
        """Add a listener; return once its channel's subscription is confirmed."""
        channel = inbox.channel
        self.listeners.setdefault(channel, set()).add(inbox)
        if channel in self._live:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(channel, []).append(waiter)
        self._subscribe(channel)
        try:
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await waiter
        except TimeoutError:
            self.leave(inbox)
            raise RedisConnectionError("no SUBSCRIBE confirmation from Redis") from None
        except BaseException:
            self.leave(inbox)
            raise

    def leave(self, inbox: Inbox) -> None:
        """Remove a listener; the channel's last one unsubscribes it (soon, in the
        background: nothing waits on an UNSUBSCRIBE)."""
        channel = inbox.channel
        listeners = self.listeners.get(channel)
        if listeners is None or inbox not in listeners:
            return
        listeners.discard(inbox)
        if listeners:
            return
        del self.listeners[channel]
        self._live.discard(channel)
        self._waiters.pop(channel, None)
        self._to_repair.discard(channel)
        self._to_unsubscribe.add(channel)
        if self._unsubscribing is None or self._unsubscribing.done():
            self._unsubscribing = asyncio.create_task(self._unsubscribe())

    def _subscribe(self, channel: bytes) -> None:
        """Subscribe `channel` soon, in the background, with every other channel asked for
        in the same turn of the event loop: one SUBSCRIBE, one write, for all of them."""
        self._to_subscribe.add(channel)
        if self._subscribing is None or self._subscribing.done():
            self._subscribing = asyncio.create_task(self._send_subscribes())

    async def _send_subscribes(self) -> None:
        while self._to_subscribe:
            async with self._lock:
                channels = [c for c in self._to_subscribe if self._needs_subscribe(c)]
                self._to_subscribe.clear()
                connection = self._connection
                # Down: its reconnection subscribes every listener's channel; lost on the
                # way: the reconnection does too.
                if connection is not None and channels:
                    with contextlib.suppress(*BROKER_ERRORS):
                        await self._send(connection, _SUBSCRIBE, *channels)

    def _needs_subscribe(self, channel: bytes) -> bool:
        if channel not in self.listeners or channel in self._live:
            return False  # left meanwhile, or subscribed already
        in_flight = self._in_flight.get(channel)
        # Another listener's SUBSCRIBE is on its way: its answer will do.
        return not (in_flight and in_flight[-1] == _SUBSCRIBE)

    async def _unsubscribe(self) -> None:
        while self._to_unsubscribe:
            async with self._lock:
                # A listener that joined meanwhile keeps its channel.
                channels = [c for c in self._to_unsubscribe if c not in self.listeners]
                self._to_unsubscribe.clear()
                if self._connection is not None and channels:
                    with contextlib.suppress(*BROKER_ERRORS):
                        await self._send(self._connection, _UNSUBSCRIBE, *channels)

    async def _send(self, connection: AbstractConnection, kind: bytes, *channels: bytes) -> None:
        for channel in channels:
            self._in_flight.setdefault(channel, deque()).append(kind)
        await connection.send_command(kind.upper(), *channels, check_health=False)

    async def _open(self, connection: AbstractConnection) -> None:
        await connection.connect()
        async with self._lock:
            self._connection = connection
            if channels := list(self.listeners):
                await self._send(connection, _SUBSCRIBE, *channels)

    def _forget(self, connection: AbstractConnection) -> None:
        """The connection is gone, and with it every subscription it held."""
        if self._connection is connection:
            self._connection = None
        self._to_repair.update(self.listeners)
        self._in_flight.clear()
        self._live.clear()

    async def _read(self, connection: AbstractConnection) -> None:
        is_pinged = False
        while True:
            response = await connection.read_response(timeout=PING_INTERVAL_S)
            if response is None:  # silence
                if is_pinged:
                    raise RedisConnectionError("no answer to PING")
                async with self._lock:
                    await connection.send_command("PING", check_health=False)
                is_pinged = True
                continue
            is_pinged = False
            if isinstance(response, list):  # not "PONG", the answer without subscriptions
                self._dispatch(response)

    def _dispatch(self, response: list) -> None:
        kind, channel = response[0], response[1]
        if kind == _MESSAGE:
            for inbox in self.listeners.get(channel, ()):
                inbox.put(response[2])
        elif kind in (_SUBSCRIBE, _UNSUBSCRIBE):
            self._answered(kind, channel)

    def _answered(self, kind: bytes, channel: bytes) -> None:
        in_flight = self._in_flight.get(channel)
        if in_flight:
            in_flight.popleft()
            if in_flight:
                return  # the answer to the last command sent for the channel decides
            del self._in_flight[channel]
        if kind != _SUBSCRIBE or channel not in self.listeners:
            return
        self._live.add(channel)
        for waiter in self._waiters.pop(channel, []):
            if not waiter.done():
                waiter.set_result(None)
        if channel in self._to_repair:
            self._to_repair.discard(channel)
            for inbox in self.listeners[channel]:
                inbox.mark_missed()


class Subscriber:
    """The request channels of one API process over `num_connections` shared connections,
    opened from `redis`'s connection settings under the client name `CLIENT_NAME-<pid>`."""

    def __init__(self, redis: aioredis.Redis, num_connections: int, max_num_buffered: int) -> None:
        pool = redis.connection_pool
        options = {
            **pool.connection_kwargs,
            "client_name": f"{CLIENT_NAME}-{os.getpid()}",
            "decode_responses": False,
            # Its own reconnect and liveness check (`_SharedConnection`), none of the client's.
            "retry": Retry(NoBackoff(), 0),
            "retry_on_error": [],
            "health_check_interval": 0,
            "socket_timeout": None,
            "socket_connect_timeout": pool.connection_kwargs.get("socket_connect_timeout") or 5,
        }
        make_connection = functools.partial(pool.connection_class, **options)
        self._connections = [_SharedConnection(make_connection) for _ in range(num_connections)]
        self._max_num_buffered = max_num_buffered
        self._tasks: list[asyncio.Task] = []
        self.is_refusing = False

    @property
    def num_listeners(self) -> int:
        return sum(len(ls) for c in self._connections for ls in c.listeners.values())

    def start(self) -> None:
        self._tasks = [asyncio.create_task(c.run()) for c in self._connections]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def refuse_new(self) -> None:
        """From now on `listen` raises `SubscriberClosed`."""
        self.is_refusing = True

    async def listen(self, channel: str) -> Inbox:
        """An inbox of `channel`'s messages, from the moment Redis confirmed the subscription;
        `redis.ConnectionError` if it did not within `SUBSCRIBE_TIMEOUT_S`. Give it back with
        `stop_listening`."""
        if self.is_refusing:
            raise SubscriberClosed()
        inbox = Inbox(channel.encode(), self._max_num_buffered)
        await self._connection_of(inbox).join(inbox)
        return inbox

    def stop_listening(self, inbox: Inbox) -> None:
        self._connection_of(inbox).leave(inbox)

    def interrupt_all(self, reason: str) -> None:
        """Interrupt every listener (`Inbox.interrupt`)."""
        for connection in self._connections:
            for listeners in connection.listeners.values():
                for inbox in listeners:
                    inbox.interrupt(reason)

    def _connection_of(self, inbox: Inbox) -> _SharedConnection:
        return self._connections[zlib.crc32(inbox.channel) % len(self._connections)]
