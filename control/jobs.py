"""The control process (`llmfleet control`): an arq worker that writes usage to the ledger,
purges prompts and outputs past their retention, and exports signed chain heads.

Usage jobs come from whoever ends a request (`shared/usage_jobs.py`). arq removes a job from
its queue only once the function returned, so a job whose control process died is run
again, and one whose database is down raises `Retry` and waits.
"""

from __future__ import annotations

import asyncio
import logging

from arq import Retry, cron
from arq.worker import Worker
from sqlalchemy.exc import InterfaceError, OperationalError

from control import ledger, usage_writer
from shared import keys
from shared.protocol import UsageEvent
from shared.redis_conn import async_client
from shared.settings import Settings
from shared.usage_jobs import JOB_EXPIRES_MS, arq_client, dumps, loads

log = logging.getLogger("llmfleet.control")

# A usage job waits out a database outage of any length: retried, never dropped for tries.
MAX_TRIES = 1_000_000
MAX_RETRY_DEFER_S = 30.0


async def record_usage(ctx: dict, event_data: dict) -> bool:
    """The job: write one usage event to the ledger; `Retry` while the database is down."""
    event = UsageEvent.model_validate(event_data)
    settings: Settings = ctx["settings"]
    try:
        return await asyncio.to_thread(
            usage_writer.record, ctx["engine"], event, settings.ledger_key
        )
    except (OperationalError, InterfaceError) as exc:
        defer_s = min(0.5 * 2 ** min(ctx["job_try"], 8), MAX_RETRY_DEFER_S)
        log.warning("usage of %s not recorded yet (database unavailable)", event.request_id)
        raise Retry(defer=defer_s) from exc


async def purge_expired_content(ctx: dict) -> int:
    num_purged = await asyncio.to_thread(usage_writer.purge_expired_content, ctx["engine"])
    if num_purged:
        log.info("purged %d requests' content past retention", num_purged)
    return num_purged


async def export_chain_heads(ctx: dict) -> int:
    settings: Settings = ctx["settings"]
    export = await asyncio.to_thread(
        ledger.export_heads, ctx["engine"], settings.ledger_key, settings.ledger_heads_dir
    )
    assert export.id is not None  # the commit gave the row its id
    return export.id


def make_worker(
    settings: Settings, engine, *, queue_name: str = keys.CONTROL_QUEUE, burst: bool = False
) -> Worker:
    """The arq worker of the control process, on `engine` (schema migrated by the caller)."""
    # arq logs each job's arguments at INFO; a usage event may hold a retained prompt.
    logging.getLogger("arq.worker").setLevel(logging.WARNING)
    return Worker(
        functions=[record_usage],
        cron_jobs=[
            cron(purge_expired_content, minute=set(range(0, 60, 10)), run_at_startup=True),
            cron(export_chain_heads, minute=0, run_at_startup=True),
        ],
        queue_name=queue_name,
        redis_pool=arq_client(async_client(settings.redis_url)),
        ctx={"settings": settings, "engine": engine},
        max_tries=MAX_TRIES,
        burst=burst,
        poll_delay=0.1,
        handle_signals=not burst,
        job_serializer=dumps,
        job_deserializer=loads,
        expires_extra_ms=JOB_EXPIRES_MS,
    )
