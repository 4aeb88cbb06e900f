"""The control process (`llmfleet control`): an arq worker that writes usage to the ledger,
purges prompts and outputs past their retention, exports signed chain heads, moves
canary rollouts on every second (`control/rollouts.py`), assigns the shared pool's
workers their models (`control/pool.py`) and, with a policy set, decides how many workers
each model version wants (`control/scaler.py`).

Usage jobs come from whoever ends a request (`shared/usage_jobs.py`). arq removes a job from
its queue only once the function returned, so a job whose control process died is run
again, and one whose database is down raises `Retry` and waits.

The rollout and pool ticks are loops of their own beside arq's, not arq cron jobs: a job a second
would leave an hour of result keys in Redis, and one that cannot be enqueued (a broker
out of memory) would end arq's loop. Redis errors of arq's own poll are logged and waited
out the same way, so the process outlives a broker that refuses writes or restarts.
"""

from __future__ import annotations

import asyncio
import logging

from arq import Retry, cron
from arq.worker import Worker
from redis.exceptions import RedisError
from sqlalchemy.exc import InterfaceError, OperationalError

from control import ledger, pool, rollouts, usage_writer
from control.scaler import Scaler, ScalerSettings
from shared import keys
from shared.canary_health import Margins
from shared.protocol import UsageEvent
from shared.redis_conn import async_client
from shared.settings import Settings
from shared.usage_jobs import JOB_EXPIRES_MS, arq_client, dumps, loads

log = logging.getLogger("llmfleet.control")

# A usage job waits out a database outage of any length: retried, never dropped for tries.
MAX_TRIES = 1_000_000
MAX_RETRY_DEFER_S = 30.0
ROLLOUT_TICK_S = 1.0
REDIS_ERROR_BACKOFF_S = 1.0


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


async def advance_rollouts_forever(ctx: dict) -> None:
    """The rollout loop: every second, judge, step, promote or roll back each running
    rollout. A tick that fails (Redis or the database unavailable) is logged; the next
    one tries again."""
    settings: Settings = ctx["settings"]
    margins = Margins.of(settings)
    while True:
        try:
            await rollouts.advance_all(ctx["redis"], ctx["engine"], margins)
        except Exception:
            log.warning("rollout tick failed; retrying in %.0f s", ROLLOUT_TICK_S, exc_info=True)
        await asyncio.sleep(ROLLOUT_TICK_S)


async def _start_loops(ctx: dict) -> None:
    """The loops beside arq's: rollouts, the shared pool's assignments, and the
    autoscaler when a policy is set."""
    settings: Settings = ctx["settings"]
    pool_settings = pool.PoolSettings.of(settings)
    ctx["loops"] = [
        asyncio.create_task(advance_rollouts_forever(ctx)),
        asyncio.create_task(pool.rebalance_forever(ctx["redis"], ctx["engine"], pool_settings)),
    ]
    if settings.autoscale_policy != "off":
        scaler = Scaler(ctx["redis"], ctx["engine"], ScalerSettings.of(settings))
        ctx["loops"].append(asyncio.create_task(scaler.run_forever()))
        log.info("autoscaling with the %s policy", settings.autoscale_policy)


async def _stop_loops(ctx: dict) -> None:
    for task in ctx.get("loops", []):
        task.cancel()


class ControlWorker(Worker):
    """arq's worker, whose poll outlives a Redis error: logged, then tried again after a
    pause (arq's own loop would end on the first one, and the process with it)."""

    async def _poll_iteration(self) -> None:
        try:
            await super()._poll_iteration()
        except RedisError as exc:
            log.warning("broker error in the control loop (%s); retrying", exc)
            await asyncio.sleep(REDIS_ERROR_BACKOFF_S)


def make_worker(
    settings: Settings, engine, *, queue_name: str = keys.CONTROL_QUEUE, burst: bool = False
) -> Worker:
    """The arq worker of the control process, on `engine` (schema migrated by the caller)."""
    # arq logs each job's arguments at INFO; a usage event may hold a retained prompt.
    logging.getLogger("arq.worker").setLevel(logging.WARNING)
    cron_jobs = [
        cron(purge_expired_content, minute=set(range(0, 60, 10)), run_at_startup=True),
        cron(export_chain_heads, minute=0, run_at_startup=True),
    ]
    # A burst run (tests) stops once its queue is empty: no rollout loop there.
    return ControlWorker(
        functions=[record_usage],
        cron_jobs=cron_jobs,
        on_startup=None if burst else _start_loops,
        on_shutdown=None if burst else _stop_loops,
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
