"""The SQL layer on PostgreSQL (psycopg 3): runs when a server is reachable, else skips visibly.

Uses DATABASE_URL when set, else the CI machines' server at 127.0.0.1:5432, database `test`.
Each run works in a schema of its own, dropped at the end.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError
from sqlmodel import Session, select

from control import ledger, usage_writer
from shared import tenants, usage
from shared.db import create_schema
from shared.protocol import QueuedRequest, SamplingParams
from shared.settings import _with_psycopg_driver
from shared.tables import UsageRecord
from tests.helpers import add_deployment

URL = _with_psycopg_driver(
    os.environ.get("DATABASE_URL") or "postgresql://postgres@127.0.0.1:5432/test"
)


@pytest.fixture(scope="module")
def pg():
    schema = f"llmfleet_test_{uuid.uuid4().hex[:8]}"
    admin = create_engine(URL)
    try:
        with admin.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA {schema}"))
    except OperationalError as exc:
        pytest.skip(f"PostgreSQL not reachable at {URL}: {exc.orig}")
    engine = create_engine(URL, connect_args={"options": f"-csearch_path={schema}"})
    create_schema(engine)
    yield engine
    engine.dispose()
    with admin.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


def test_keys_and_usage_on_postgres(pg):
    tenant = tenants.create_tenant(pg, "pg-tenant")
    key = tenants.create_key(pg, tenant.id, b"pepper")
    assert tenants.authenticate(pg, key, b"pepper").tenant_id == tenant.id
    assert tenants.authenticate(pg, key, b"other-pepper") is None
    deployment_id = add_deployment(pg, "m").id
    request = QueuedRequest(
        request_id="cmpl-pg",
        tenant_id=tenant.id,
        model="m",
        deployment_id=deployment_id,
        kind="completion",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(),
        arrival_ts=time.time(),
    )
    final = {"finish_reason": "length", "num_output_tokens": 16, "num_computed_tokens": 18}
    assert usage_writer.record(pg, usage.usage_event(request, **final), b"k")
    assert not usage_writer.record(
        pg, usage.usage_event(request, **final), b"k"
    )  # a second delivery
    with Session(pg) as session:
        rows = session.exec(select(UsageRecord).where(UsageRecord.request_id == "cmpl-pg")).all()
    assert [(r.input_tokens, r.output_tokens) for r in rows] == [(3, 16)]


def test_migrations_match_the_tables_on_postgres(pg):
    from tests.shared.test_migrations import schema_diff

    assert schema_diff(pg) == []


def test_concurrent_appends_keep_one_chain_on_postgres(pg):
    tenant = tenants.create_tenant(pg, "pg-ledger")
    deployment_id = add_deployment(pg, "m-ledger").id

    def append(i: int) -> None:
        request = QueuedRequest(
            request_id=f"pg-chain-{i}",
            tenant_id=tenant.id,
            model="m",
            deployment_id=deployment_id,
            kind="completion",
            prompt_token_ids=[1],
            sampling=SamplingParams(),
            arrival_ts=time.time(),
        )
        final = {"finish_reason": "stop", "num_output_tokens": i, "num_computed_tokens": i + 1}
        usage_writer.record(pg, usage.usage_event(request, **final), b"k")

    threads = [threading.Thread(target=append, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with Session(pg) as session:
        query = select(UsageRecord.seq).where(UsageRecord.tenant_id == tenant.id)
        assert sorted(session.exec(query).all()) == list(range(1, 9))
    assert ledger.verify(pg, b"k", tenant.id) == []
    with pg.begin() as conn:
        conn.execute(
            text("UPDATE usagerecord SET input_tokens = 9 WHERE request_id = 'pg-chain-3'")
        )
    assert [p.kind for p in ledger.verify(pg, b"k", tenant.id)] == ["edited"]
