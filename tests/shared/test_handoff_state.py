"""The hand-off record (shared/handoff.py) against the test Redis: whatever the order of
offers, accepts and withdrawals, retries included, exactly one of sender and receiver holds
the request."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from shared import keys
from shared.handoff import ACCEPTED, OFFERED, WITHDRAWN, HandOffs, HandOffState

TTL_S = 60
NUM_RACES = 50


@pytest.fixture
def handoffs(aredis) -> HandOffs:
    return HandOffs(aredis, ttl_s=TTL_S)


@pytest.fixture
def new_request_id(rdb):
    """Factory: a fresh request id; its hand-off record goes after the test."""
    made: list[str] = []

    def factory() -> str:
        made.append(f"handoff-test-{uuid.uuid4().hex}")
        return made[-1]

    yield factory
    if made:
        rdb.delete(*(keys.handoff(request_id) for request_id in made))


async def test_an_accepted_offer_is_the_receivers_and_cannot_be_withdrawn(handoffs, new_request_id):
    request_id = new_request_id()
    assert await handoffs.offer(request_id, "prefill-1", "decode-1")
    assert await handoffs.state(request_id) == HandOffState("prefill-1", "decode-1", OFFERED)

    assert await handoffs.accept(request_id, "decode-1")
    assert not await handoffs.withdraw(request_id, "prefill-1")
    assert await handoffs.state(request_id) == HandOffState("prefill-1", "decode-1", ACCEPTED)


async def test_a_withdrawn_offer_stays_with_the_sender_and_cannot_be_accepted(
    handoffs, new_request_id
):
    request_id = new_request_id()
    assert await handoffs.offer(request_id, "prefill-1", "decode-1")

    assert await handoffs.withdraw(request_id, "prefill-1")
    assert not await handoffs.accept(request_id, "decode-1")
    assert await handoffs.state(request_id) == HandOffState("prefill-1", "decode-1", WITHDRAWN)


async def test_another_senders_offer_is_refused_while_one_is_pending(handoffs, new_request_id):
    request_id = new_request_id()
    assert await handoffs.offer(request_id, "prefill-1", "decode-1")

    assert not await handoffs.offer(request_id, "prefill-2", "decode-2")
    # Nor may the sender point its pending offer elsewhere: decode-1 could still accept it.
    assert not await handoffs.offer(request_id, "prefill-1", "decode-2")
    assert await handoffs.state(request_id) == HandOffState("prefill-1", "decode-1", OFFERED)


async def test_an_accepted_request_cannot_be_offered_again(handoffs, new_request_id):
    request_id = new_request_id()
    assert await handoffs.offer(request_id, "prefill-1", "decode-1")
    assert await handoffs.accept(request_id, "decode-1")

    assert not await handoffs.offer(request_id, "prefill-1", "decode-2")
    assert not await handoffs.offer(request_id, "prefill-2", "decode-2")
    assert await handoffs.state(request_id) == HandOffState("prefill-1", "decode-1", ACCEPTED)


async def test_after_a_withdrawal_the_sender_may_offer_to_another_receiver(
    handoffs, new_request_id
):
    request_id = new_request_id()
    assert await handoffs.offer(request_id, "prefill-1", "decode-1")
    assert await handoffs.withdraw(request_id, "prefill-1")

    assert await handoffs.offer(request_id, "prefill-1", "decode-2")
    assert await handoffs.state(request_id) == HandOffState("prefill-1", "decode-2", OFFERED)
    assert not await handoffs.accept(request_id, "decode-1")  # the first receiver, too late
    assert await handoffs.accept(request_id, "decode-2")


async def test_only_the_sender_that_withdrew_may_offer_again(handoffs, new_request_id):
    request_id = new_request_id()
    assert await handoffs.offer(request_id, "prefill-1", "decode-1")
    assert await handoffs.withdraw(request_id, "prefill-1")

    assert not await handoffs.offer(request_id, "prefill-2", "decode-2")
    assert await handoffs.state(request_id) == HandOffState("prefill-1", "decode-1", WITHDRAWN)


async def test_a_receiver_not_named_cannot_accept(handoffs, new_request_id):
    request_id = new_request_id()
    assert await handoffs.offer(request_id, "prefill-1", "decode-1")

    assert not await handoffs.accept(request_id, "decode-2")
    assert await handoffs.state(request_id) == HandOffState("prefill-1", "decode-1", OFFERED)
    assert await handoffs.accept(request_id, "decode-1")


async def test_without_an_offer_nothing_can_be_accepted_or_withdrawn(handoffs, new_request_id):
    request_id = new_request_id()
    assert not await handoffs.accept(request_id, "decode-1")
    assert not await handoffs.withdraw(request_id, "prefill-1")
    assert await handoffs.state(request_id) is None


async def test_another_sender_cannot_withdraw_an_offer(handoffs, new_request_id):
    request_id = new_request_id()
    assert await handoffs.offer(request_id, "prefill-1", "decode-1")

    assert not await handoffs.withdraw(request_id, "prefill-2")
    assert await handoffs.accept(request_id, "decode-1")


async def test_retries_get_the_first_answer(handoffs, new_request_id):
    # The Redis client retries a command whose reply was lost: a retry of a call that ran
    # must not read as a refusal (nor a refusal turn into a success).
    accepted, withdrawn = new_request_id(), new_request_id()
    for _ in range(2):
        assert await handoffs.offer(accepted, "prefill-1", "decode-1")
    for _ in range(2):
        assert await handoffs.accept(accepted, "decode-1")
    for _ in range(2):
        assert not await handoffs.withdraw(accepted, "prefill-1")

    assert await handoffs.offer(withdrawn, "prefill-1", "decode-1")
    for _ in range(2):
        assert await handoffs.withdraw(withdrawn, "prefill-1")
    for _ in range(2):
        assert not await handoffs.accept(withdrawn, "decode-1")

    assert (await handoffs.state(accepted)).state == ACCEPTED
    assert (await handoffs.state(withdrawn)).state == WITHDRAWN


async def test_every_write_sets_the_ttl(handoffs, new_request_id, rdb):
    request_id = new_request_id()
    key = keys.handoff(request_id)
    assert await handoffs.offer(request_id, "prefill-1", "decode-1")
    assert 0 < rdb.ttl(key) <= TTL_S

    rdb.persist(key)
    assert await handoffs.withdraw(request_id, "prefill-1")
    assert 0 < rdb.ttl(key) <= TTL_S

    rdb.persist(key)
    assert await handoffs.offer(request_id, "prefill-1", "decode-2")
    assert 0 < rdb.ttl(key) <= TTL_S

    rdb.persist(key)
    assert await handoffs.accept(request_id, "decode-2")
    assert 0 < rdb.ttl(key) <= TTL_S


async def test_forget_deletes_the_record(handoffs, new_request_id, rdb):
    request_id = new_request_id()
    assert await handoffs.offer(request_id, "prefill-1", "decode-1")

    await handoffs.forget(request_id)
    assert not rdb.exists(keys.handoff(request_id))
    assert await handoffs.state(request_id) is None


async def test_accept_racing_withdraw_leaves_exactly_one_holder(handoffs, new_request_id):
    # The decode worker accepts just as the sender, its answer late, withdraws.
    for _ in range(NUM_RACES):
        request_id = new_request_id()
        assert await handoffs.offer(request_id, "prefill-1", "decode-1")

        is_accepted, is_withdrawn = await asyncio.gather(
            handoffs.accept(request_id, "decode-1"), handoffs.withdraw(request_id, "prefill-1")
        )
        assert is_accepted != is_withdrawn
        state = await handoffs.state(request_id)
        assert state.state == (ACCEPTED if is_accepted else WITHDRAWN)
