"""The control process's jobs (control/jobs.py), run by an in-process arq worker on the
test Redis: usage written once, a database outage waited out, content kept and purged
under a retention policy (end to end through the session's control process:
tests/e2e/test_control.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from arq.constants import job_key_prefix
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy import create_engine
from sqlmodel import select

from control import jobs, usage_writer
from shared import usage, usage_jobs
from shared.db import session_scope
from shared.protocol import QueuedRequest, SamplingParams
from shared.tables import RequestContent, UsageRecord
from tests.helpers import add_deployment


@pytest.fixture(scope="module")
def deployment_id(db) -> int:
    return add_deployment(db, f"control-{uuid.uuid4().hex[:6]}").id


def make_event(tenant_id: str, deployment_id: int, *, retention_days: int | None = None):
    request = QueuedRequest(
        request_id=f"ctl-{uuid.uuid4().hex[:10]}",
        tenant_id=tenant_id,
        model="m",
        deployment_id=deployment_id,
        kind="completion",
        prompt_token_ids=[5, 6, 7],
        sampling=SamplingParams(),
        arrival_ts=time.time(),
        content_retention_days=retention_days,
    )
    return usage.usage_event(
        request,
        finish_reason="stop",
        num_output_tokens=2,
        num_computed_tokens=5,
        output_text="hi there",
    )


def records_of(db, request_id: str) -> list[UsageRecord]:
    with session_scope(db) as session:
        query = select(UsageRecord).where(UsageRecord.request_id == request_id)
        return session.exec(query).all()


# A queue of this module's own: the session's control process must not take these jobs.
QUEUE = f"llmfleet:control-test-{uuid.uuid4().hex[:6]}"


async def run_burst(settings, engine) -> None:
    worker = jobs.make_worker(settings, engine, queue_name=QUEUE, burst=True)
    try:
        await worker.main()
    finally:
        await worker.close()


async def test_a_usage_event_is_recorded_once(db, settings, aredis, make_tenant, deployment_id):
    tenant_id, _key = make_tenant("control")
    event = make_event(tenant_id, deployment_id)
    await usage_jobs.enqueue_usage(aredis, event, QUEUE)
    await usage_jobs.enqueue_usage(aredis, event, QUEUE)  # a double delivery: the same job id
    await run_burst(settings, db)
    assert [(r.input_tokens, r.output_tokens, r.seq) for r in records_of(db, event.request_id)] == [
        (3, 2, 1)
    ]
    await jobs.record_usage(
        {"settings": settings, "engine": db, "job_try": 1}, event.model_dump(mode="json")
    )
    assert len(records_of(db, event.request_id)) == 1  # a late redelivery: insert-if-absent


async def test_a_usage_job_whose_reply_was_lost_is_enqueued_once_by_the_retry(
    db, settings, aredis, make_tenant, deployment_id, monkeypatch
):
    """The enqueue ran but its connection broke before the reply came: the caller sees a
    connection error and retries (`shared/ending.py`), which finds the job there and adds
    nothing; the job is whole (arq's form, its expiry) and recorded once."""
    tenant_id, _key = make_tenant("control-lost")
    event = make_event(tenant_id, deployment_id)
    job_id = usage_jobs.usage_job_id(event.request_id)
    execute = aredis.execute_command

    async def reply_lost(*args, **options):
        reply = await execute(*args, **options)
        if args[0] == "EVALSHA":
            raise RedisConnectionError("Connection closed by server.")
        return reply

    with monkeypatch.context() as patch:
        patch.setattr(aredis, "execute_command", reply_lost)
        with pytest.raises(RedisConnectionError):
            await usage_jobs.enqueue_usage(aredis, event, QUEUE)
    assert await aredis.zscore(QUEUE, job_id) is not None
    assert await aredis.pttl(job_key_prefix + job_id) > usage_jobs.JOB_EXPIRES_MS - 60_000
    assert await usage_jobs.enqueue_usage(aredis, event, QUEUE) is False  # the retry
    assert await aredis.zcard(QUEUE) == 1
    await run_burst(settings, db)
    assert len(records_of(db, event.request_id)) == 1
    # Done, its result kept: a late redelivery enqueues nothing either.
    assert await usage_jobs.enqueue_usage(aredis, event, QUEUE) is False


async def test_a_database_outage_is_waited_out(
    db, settings, aredis, make_tenant, deployment_id, tmp_path
):
    tenant_id, _key = make_tenant("control-outage")
    event = make_event(tenant_id, deployment_id)
    await usage_jobs.enqueue_usage(aredis, event, QUEUE)
    unreachable = create_engine(f"sqlite:///{tmp_path / 'missing' / 'x.db'}")
    worker = jobs.make_worker(settings, unreachable, queue_name=QUEUE, burst=True)
    task = asyncio.create_task(worker.main())
    try:
        await asyncio.sleep(1.5)
        assert records_of(db, event.request_id) == []
        assert await aredis.zscore(QUEUE, usage_jobs.usage_job_id(event.request_id))
        worker.ctx["engine"] = db  # the database is back
        await asyncio.wait_for(task, timeout=30)
    finally:
        task.cancel()
        await worker.close()
    assert len(records_of(db, event.request_id)) == 1


async def test_content_is_kept_only_under_a_retention_policy(
    db, settings, aredis, make_tenant, deployment_id
):
    tenant_id, _key = make_tenant("control-retention")
    kept = make_event(tenant_id, deployment_id, retention_days=7)
    not_kept = make_event(tenant_id, deployment_id)
    assert not_kept.prompt_token_ids is None and not_kept.output_text is None
    for event in (kept, not_kept):
        await usage_jobs.enqueue_usage(aredis, event, QUEUE)
    await run_burst(settings, db)
    with session_scope(db) as session:
        rows = session.exec(
            select(RequestContent).where(RequestContent.tenant_id == tenant_id)
        ).all()
    assert [(r.request_id, r.prompt_token_ids_json, r.output) for r in rows] == [
        (kept.request_id, "[5, 6, 7]", "hi there")
    ]
    assert usage_writer.purge_expired_content(db, datetime.now(UTC) + timedelta(days=6)) == 0
    assert usage_writer.purge_expired_content(db, datetime.now(UTC) + timedelta(days=8)) >= 1
    with session_scope(db) as session:
        assert session.get(RequestContent, kept.request_id) is None
