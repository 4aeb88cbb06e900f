"""The pool's service counters in a real Redis: every worker adds what it computed and
reads back everyone's, in one script; the Python rule the simulation uses agrees."""

from __future__ import annotations

import uuid

import pytest

from cli.redis_server import EmbeddedRedis, free_port
from shared import keys
from worker.pool_service import PoolService, merge_service
from worker.tenant_counters import ServiceUpdates


async def test_workers_add_their_service_and_lifts_only_raise_a_counter(aredis):
    model = f"m-{uuid.uuid4().hex[:8]}"
    worker_1, worker_2 = PoolService(aredis, model), PoolService(aredis, model)
    updates = [
        (worker_1, ServiceUpdates({"a": 100.0, "b": 2.5}, {})),
        (worker_2, ServiceUpdates({"a": 50.0}, {"c": 40.0})),
        (worker_1, ServiceUpdates({}, {"c": 10.0, "b": 500.0})),  # c's floor is below: kept
    ]
    expected: dict[str, float] = {}
    for worker, update in updates:
        counters = await worker.sync(update)
        merge_service(expected, update)
        assert counters == pytest.approx(expected)
    assert expected == {"a": 150.0, "b": 500.0, "c": 40.0}
    assert await aredis.ttl(keys.tenant_service(model)) > 0


async def test_updates_of_a_sync_that_failed_go_with_the_next(tmp_path):
    # A Redis of its own, stopped and started again on the same port and data.
    from shared.redis_conn import async_client

    port = free_port()
    server = EmbeddedRedis(tmp_path, port=port).start()
    client = async_client(server.url, retries=0)
    pool = PoolService(client, "m")
    try:
        assert await pool.sync(ServiceUpdates({"a": 1.0})) == {"a": 1.0}
        server.stop()
        assert await pool.sync(ServiceUpdates({"a": 7.0}, {"b": 3.0})) is None
        server = EmbeddedRedis(tmp_path, port=port).start()
        assert await pool.sync(ServiceUpdates({"a": 1.0})) == {"a": 9.0, "b": 3.0}
    finally:
        await client.aclose()
        server.stop()
