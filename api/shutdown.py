"""Graceful shutdown of an API process: no stream is cut, and none of their requests is lost.

On SIGTERM (or SIGINT) the process, in order:

1. fails its readiness check (`/readyz` answers 503), so a load balancer stops sending it
   work, and refuses new completions and resume streams (503 `shutting_down`, with
   `Retry-After`); `/healthz`, the liveness check, stays 200;
2. lets its open streams finish, for up to `LLMFLEET_SHUTDOWN_GRACE_S`;
3. interrupts each stream still open (`Interruption.API_SHUTDOWN`): at its next event's
   boundary it ends with an error event `api_shutdown` that names the request and the last
   event delivered, then `[DONE]` (`api/streaming.py`). Its request runs on, not
   cancelled, so its client resumes it on another replica (`GET /v1/requests/{id}/events`
   with that `Last-Event-ID`) and gets the rest;
4. hands the signal to the server (uvicorn), which closes its listener, waits for the
   connections still open and exits.

Why a signal hook of our own: uvicorn closes its listening socket as soon as it sees the
signal (a readiness probe would get no answer, and neither would liveness), and cancels
whatever still runs once its own graceful timeout passes (cut mid-stream, no `[DONE]`).
Handed over after step 3, it finds nothing left to cut. A second signal
skips what is left of the grace.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from api.broker import Interruption
from api.subscriber import Subscriber

log = logging.getLogger("llmfleet.api")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# After the interruption, how long the drain waits for the streams to write their last
# events before it hands over anyway (a client that reads nothing holds its stream's
# last write: `api/streaming.py`, `stream_send_timeout_s`).
END_TIMEOUT_S = 5.0
_POLL_S = 0.1

Handler = Callable[[int, FrameType | None], object] | int | None


@dataclass
class Shutdown:
    """The process's shutdown: whether it has begun (`is_draining`), and the drain."""

    grace_s: float
    subscriber: Subscriber
    is_draining: bool = False
    _skip_grace: asyncio.Event = field(default_factory=asyncio.Event)
    _previous: dict[int, Handler] = field(default_factory=dict)
    _drain: asyncio.Task | None = None

    def install(self) -> Callable[[], None]:
        """Take SIGTERM and SIGINT from the server, in the main thread only (elsewhere, as
        under a test client's thread, the server keeps them); returns what gives them back."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        loop = asyncio.get_running_loop()

        def on_signal(sig: int, _frame: FrameType | None) -> None:
            # A signal handler runs between two bytecodes of the loop's thread: hand over.
            loop.call_soon_threadsafe(self.begin, sig)

        self._previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
        for sig in SIGNALS:
            signal.signal(sig, on_signal)
        return self._restore_handlers

    def begin(self, sig: int = signal.SIGTERM) -> None:
        """Start draining (a second call skips what is left of the grace)."""
        if self.is_draining:
            self._skip_grace.set()
            return
        self.is_draining = True
        self.subscriber.refuse_new()
        log.info(
            "shutting down: %d streams open, %.0f s to finish",
            self.subscriber.num_listeners,
            self.grace_s,
        )
        self._drain = asyncio.create_task(self._run(sig))

    async def _run(self, sig: int) -> None:
        await self._wait_for_streams(self.grace_s)
        if num_open := self.subscriber.num_listeners:
            log.info("shutting down: interrupting %d streams (resume them elsewhere)", num_open)
            self.subscriber.interrupt_all(Interruption.API_SHUTDOWN)
            await self._wait_for_streams(END_TIMEOUT_S)
        self._hand_over(sig)

    async def _wait_for_streams(self, timeout_s: float) -> None:
        deadline_s = time.monotonic() + timeout_s
        while self.subscriber.num_listeners and not self._skip_grace.is_set():
            if time.monotonic() >= deadline_s:
                return
            await asyncio.sleep(_POLL_S)

    def _hand_over(self, sig: int) -> None:
        """The server's own handling of the signal, now (and of any signal after it)."""
        if not self._previous:
            return  # not installed: nobody's signal to hand over
        handler = self._previous[sig]
        self._restore_handlers()
        if callable(handler):
            handler(sig, None)
        else:
            signal.raise_signal(sig)

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
