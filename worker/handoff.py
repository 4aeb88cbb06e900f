"""Prefill/decode disaggregation in the worker process (issue 22): a prefill worker computes a
request's prompt and first token, then hands the sequence to a decode worker, which streams
the rest.

The hand-off, in order:

1. **Let go** (`Sender.__call__`, the engine's `hand_off` callback, on the engine thread):
   at its first token a sequence is offered to the decode workers that had room for it at
   their last heartbeat (`keys.decode_workers`); its KV blocks and sampler state are copied
   out of the runner, and it leaves the batch (its blocks free for the next prompts).
2. **Send** (`Sender.send`, in the event loop, once the step that sampled the first token
   is published, so the decode worker's events follow it in the journal): the hand-off is
   recorded in Redis as *offered* (`shared/handoff.py`), and the blocks go straight to the
   decode worker over ZeroMQ (`worker/kv_link.py`), never through the broker, with the
   request, its stream entry, the first token, the journal's event count and the sampler
   state in the header.
3. **Adopt** (`Receiver`, on the decode worker): its thread takes the transfer and the
   worker loop, between two steps, puts the sequence into the batch if it has room
   (`ContinuousBatchingEngine.adopt`: never more than its KV cache holds), marks the
   hand-off *accepted* in Redis, claims the stream entry (so crash recovery follows the
   request here) and only then answers the sender.
4. **Settle**: with the answer the sender forgets the request. Without one in time it
   *withdraws* the offer in Redis: if that succeeds, the decode worker can no longer accept,
   and the sender tries the next decode worker or takes the sequence back into its own batch
   (`Sender.take_back`); if the decode worker had accepted (its answer was lost), the request
   is the decode worker's. So exactly one worker holds the request whatever is lost.

A worker that dies holds its request's stream entry: crash recovery (`worker/recovery.py`)
ends a started request once, with `worker_lost` and its delivered tokens' usage.

No torch here: the runner copies blocks in and out (`ModelRunner.export_kv`, `import_kv`).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from shared import keys
from shared.handoff import HandOffs
from shared.protocol import QueuedRequest
from shared.redis_conn import BROKER_ERRORS, retrying, text
from worker.intake import StreamEntry
from worker.kv_link import KVReceiver, KVSender, KVTransfer, KVTransferError, KVTransferRefused
from worker.sequence import Sequence

log = logging.getLogger("llmfleet.worker")

ROLE_BOTH, ROLE_PREFILL, ROLE_DECODE = "both", "prefill", "decode"
ROLES = (ROLE_BOTH, ROLE_PREFILL, ROLE_DECODE)
# How long a prefill worker waits for a decode worker's answer before it withdraws the
# offer: the adoption waits for the decode worker's step in flight (tens of ms here).
ANSWER_TIMEOUT_S = 5.0
MAX_RECEIVERS_TRIED = 2  # then the prefill worker decodes the sequence itself
DECODERS_REFRESH_S = 0.25  # how often a prefill worker reads the decode workers' room
# A decode worker that did not answer gets no offers for this long: dead (until its
# heartbeat expires it is still listed), hung or cut off, it would cost each offer queued
# behind the first its own timeout.
SHUN_S = 10.0


class HandOffRefused(Exception):
    """A decode worker does not take a hand-off (no room, or the offer was withdrawn)."""


@dataclass(frozen=True, slots=True)
class DecodeWorker:
    worker_id: str
    endpoint: str
    free_blocks: int  # at its last heartbeat


@dataclass(slots=True)
class Offer:
    """A sequence let go at its first token, with what a decode worker needs to go on."""

    seq: Sequence
    num_blocks: int
    payload: memoryview  # its KV blocks (`ModelRunner.export_kv`)
    sampling_state: bytes | None
    receivers: list[DecodeWorker]  # best first

    @property
    def request_id(self) -> str:
        return self.seq.request_id


class Sender:
    """The prefill side: the engine's `hand_off` callback, and the sends after the step."""

    def __init__(
        self,
        redis: aioredis.Redis,
        runner: Any,
        handoffs: HandOffs,
        worker_id: str,
        retry_s: float = 60.0,
    ) -> None:
        """`retry_s`: how long a withdrawal waits for an unreachable broker."""
        self._redis = redis
        self._retry_s = retry_s
        self._runner = runner  # `ModelRunner`: export_kv, export_sampling_state, kv_layout
        self._handoffs = handoffs
        self._worker_id = worker_id
        self._layout = runner.kv_layout.as_dict()
        self._kv_sender = KVSender()
        # One thread for every send: a ZeroMQ socket is used from one thread at a time.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-send")
        self.decoders: list[DecodeWorker] = []  # `refresh_decoders`
        self._shunned: dict[str, float] = {}  # decode worker id -> until (monotonic s)
        self.offers: list[Offer] = []  # let go in the last step, not yet sent

    def __call__(self, seq: Sequence, block_ids: list[int]) -> bool:
        """On the engine thread, in the step that sampled `seq`'s first token: let it go to a
        decode worker that has room for it (True), or keep it here (False: none has)."""
        needed = len(block_ids) + 1  # its blocks, and one for the tokens to come
        receivers = [d for d in self.decoders if d.free_blocks >= needed]
        if not receivers:
            return False
        self.offers.append(
            Offer(
                seq,
                len(block_ids),
                self._runner.export_kv(block_ids),
                self._runner.export_sampling_state(seq.request_id),
                receivers[:MAX_RECEIVERS_TRIED],
            )
        )
        return True

    def take_offers(self) -> list[Offer]:
        offers, self.offers = self.offers, []
        return offers

    async def refresh_decoders(self, deployment: str) -> None:
        """The decode workers of the deployment with room, most free blocks first."""
        ranked = await self._redis.zrevrange(
            keys.decode_workers(deployment), 0, 15, withscores=True
        )
        decoders = []
        for member, free_blocks in ranked:
            worker_id = text(member)
            endpoint = await self._redis.hget(keys.worker_heartbeat(worker_id), "kv_endpoint")  # type: ignore[misc]  # redis-py: async commands typed Awaitable[T] | T (redis-py#2399)
            if endpoint is not None and free_blocks > 0 and not self._is_shunned(worker_id):
                decoders.append(DecodeWorker(worker_id, text(endpoint), int(free_blocks)))
        self.decoders = decoders

    def _is_shunned(self, worker_id: str) -> bool:
        return self._shunned.get(worker_id, 0.0) > time.monotonic()

    def _shun(self, worker_id: str) -> None:
        self._shunned[worker_id] = time.monotonic() + SHUN_S
        self.decoders = [d for d in self.decoders if d.worker_id != worker_id]

    async def send(self, offer: Offer, entry: StreamEntry, num_events: int) -> bool:
        """Hand the offer to a decode worker: True once one holds the request (forget it
        here), False if none took it (take it back: `take_back`)."""
        request_id = offer.request_id
        header = self._header(offer, entry, num_events)
        for receiver in offer.receivers:
            if not await self._handoffs.offer(request_id, self._worker_id, receiver.worker_id):
                return not await self._withdraw(request_id)
            try:
                sent_s = time.perf_counter()
                await asyncio.get_running_loop().run_in_executor(
                    self._thread, self._send_now, receiver, header, offer.payload
                )
                transfer_s = time.perf_counter() - sent_s
            except KVTransferError as exc:
                log.warning("hand-off of %s to %s failed: %s", request_id, receiver.worker_id, exc)
                if not isinstance(exc, KVTransferRefused):  # no answer: dead, hung or cut off
                    self._shun(receiver.worker_id)
                if not await self._withdraw(request_id):
                    return True  # accepted there: its answer was what was lost
                continue
            try:
                await self._handoffs.record_transfer(request_id, offer.payload.nbytes, transfer_s)
            except BROKER_ERRORS as exc:  # only a figure: the request is the receiver's
                log.warning("could not record the transfer of %s: %s", request_id, exc)
            return True
        return False

    async def _withdraw(self, request_id: str) -> bool:
        """Whether this worker keeps the request: retried while the broker is away, since
        the answer decides which worker holds it."""
        return await retrying(
            lambda: self._handoffs.withdraw(request_id, self._worker_id),
            within_s=self._retry_s,
            what="a hand-off's withdrawal",
        )

    def _send_now(self, receiver: DecodeWorker, header: dict[str, Any], payload) -> None:
        """On the send thread, in turn: sends queued behind one that got no answer give up at
        once rather than each wait for its own timeout."""
        if self._is_shunned(receiver.worker_id):
            raise KVTransferError(f"{receiver.worker_id} did not answer an earlier offer")
        self._kv_sender.send(receiver.endpoint, header, payload, ANSWER_TIMEOUT_S)

    def take_back(self, engine: Any, offer: Offer, seq: Sequence) -> bool:
        """On the engine thread: the sequence no decode worker took, back into this batch as
        `seq` (`continued_sequence`), as a decode worker would adopt it; False while there
        is no room (try again after a step)."""
        runner, layout = self._runner, self._runner.kv_layout
        if not engine.adopt(seq, lambda blocks: runner.import_kv(blocks, layout, offer.payload)):
            return False
        runner.import_sampling_state(seq.request_id, seq.sampling, offer.sampling_state)
        return True

    def _header(self, offer: Offer, entry: StreamEntry, num_events: int) -> dict[str, Any]:
        seq, state = offer.seq, offer.sampling_state
        return {
            "request_id": seq.request_id,
            "layout": self._layout,
            "num_tokens": seq.num_tokens - 1,  # whose KV is sent: all but the first token
            "num_blocks": offer.num_blocks,
            "sender": self._worker_id,
            "stream": entry.stream,
            "entry_id": entry.entry_id,
            "request": entry.request.model_dump_json(),
            "first_token_id": seq.output_token_ids[0],
            "num_events": num_events,  # the journal's events so far: the receiver's next seq
            "sampling_state": base64.b64encode(state).decode() if state is not None else None,
        }

    def close(self) -> None:
        self._thread.submit(self._kv_sender.close).result()
        self._thread.shutdown()


@dataclass(slots=True)
class Arrival:
    """A transfer received, waiting for the worker loop's verdict (`Receiver.answer`)."""

    transfer: KVTransfer
    verdict: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    @property
    def header(self) -> dict[str, Any]:
        return self.transfer.header

    def entry(self) -> StreamEntry:
        request = QueuedRequest.model_validate_json(self.header["request"])
        return StreamEntry(self.header["stream"], self.header["entry_id"], request)

    def layout(self) -> dict[str, Any]:
        return self.header["layout"]

    def sampling_state(self) -> bytes | None:
        state = self.header.get("sampling_state")
        return base64.b64decode(state) if state is not None else None


class Receiver:
    """The decode side: a thread that takes transfers at `endpoint` and waits for the worker
    loop to adopt each (`take`, then `Arrival.verdict`) before it answers the sender. One the
    loop has not started on within `ANSWER_TIMEOUT_S` is cancelled (refused): the loop must
    skip it (`set_running_or_notify_cancel`)."""

    def __init__(self, endpoint: str, wake: Callable[[], object]) -> None:
        """`wake`: called from the receiving thread when a transfer arrives (it must be
        thread-safe: `loop.call_soon_threadsafe`)."""
        self._kv_receiver = KVReceiver(endpoint)
        self.endpoint = self._kv_receiver.endpoint
        self._wake = wake
        self._arrivals: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-receive", daemon=True)
        self._thread.start()

    def take(self) -> list[Arrival]:
        arrivals = []
        while True:
            try:
                arrivals.append(self._arrivals.get_nowait())
            except queue.Empty:
                return arrivals

    def close(self) -> None:
        self._stopping.set()
        self._thread.join()
        for arrival in self.take():  # came as the loop ended: refused
            if arrival.verdict.set_running_or_notify_cancel():
                arrival.verdict.set_exception(KVTransferError("the decode worker is stopping"))
        self._kv_receiver.close()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            self._kv_receiver.serve_one(0.1, self._accept)

    def _accept(self, transfer: KVTransfer) -> None:
        """Raises to refuse (the sender then tries elsewhere). The payload stays valid until
        this returns: the loop copies it into the pool before it answers."""
        arrival = Arrival(transfer)
        self._arrivals.put(arrival)
        self._wake()
        try:
            arrival.verdict.result(timeout=ANSWER_TIMEOUT_S)
        except TimeoutError:
            if arrival.verdict.cancel():  # the loop will skip it: refused
                raise KVTransferError("the worker loop did not take it in time") from None
            arrival.verdict.result()  # being adopted right now: its verdict


def continued_sequence(
    request: QueuedRequest, first_token_id: int, decoder: Any, eos_token_ids: frozenset[int]
) -> Sequence:
    """The sequence of a request whose prompt was computed and first token sampled, as an
    engine adopts it (`ContinuousBatchingEngine.adopt`)."""
    seq = Sequence.from_request(request, decoder, eos_token_ids)
    seq.adopt_first_token(first_token_id)
    return seq
