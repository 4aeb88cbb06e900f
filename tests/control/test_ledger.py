"""The usage ledger's chains (control/ledger.py): appends, and each kind of tampering found."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from sqlalchemy import text
from sqlmodel import select

from control import ledger, usage_writer
from shared import usage
from shared.db import session_scope
from shared.protocol import QueuedRequest, SamplingParams
from shared.settings import Settings
from shared.tables import UsageRecord
from tests.helpers import add_deployment


@pytest.fixture(scope="module")
def key(settings) -> bytes:
    """The ledger secret in effect: the head exports the session's control process stores
    are signed with it, and `verify` checks them all."""
    return settings.ledger_key


@pytest.fixture(scope="module")
def deployment_id(db) -> int:
    return add_deployment(db, f"ledger-{uuid.uuid4().hex[:6]}").id


@pytest.fixture
def make_chain(db, key, make_tenant, deployment_id):
    """Factory: a tenant with `num_records` usage records chained; its tenant id."""

    def factory(num_records: int) -> str:
        tenant_id, _key = make_tenant("ledger")
        for i in range(num_records):
            record_usage(db, key, tenant_id, deployment_id, f"req-{tenant_id}-{i}")
        return tenant_id

    return factory


def record_usage(
    db, key: bytes, tenant_id: str, deployment_id: int, request_id: str, **final
) -> None:
    request = QueuedRequest(
        request_id=request_id,
        tenant_id=tenant_id,
        model="m",
        deployment_id=deployment_id,
        kind="completion",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(),
        arrival_ts=time.time(),
    )
    final = {"finish_reason": "stop", "num_output_tokens": 5, "num_computed_tokens": 8, **final}
    usage_writer.record(db, usage.usage_event(request, **final), key)


def chain_of(db, tenant_id: str) -> list[UsageRecord]:
    with session_scope(db) as session:
        query = select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)
        return session.exec(query.order_by(UsageRecord.seq)).all()


def run_sql(db, sql: str, **params) -> None:
    with db.begin() as conn:
        conn.execute(text(sql), params)


def test_records_chain_without_gaps(db, key, make_chain):
    tenant_id = make_chain(3)
    chain = chain_of(db, tenant_id)
    assert [r.seq for r in chain] == [1, 2, 3]
    assert [r.prev_link for r in chain] == ["", chain[0].link, chain[1].link]
    assert ledger.verify(db, key, tenant_id) == []


def test_a_second_delivery_is_not_chained_twice(db, key, make_chain, deployment_id):
    tenant_id = make_chain(1)
    request_id = chain_of(db, tenant_id)[0].request_id
    record_usage(db, key, tenant_id, deployment_id, request_id, num_output_tokens=99)
    assert [(r.seq, r.output_tokens) for r in chain_of(db, tenant_id)] == [(1, 5)]


def test_concurrent_appends_keep_one_chain(db, key, make_chain, deployment_id):
    tenant_id = make_chain(0)
    threads = [
        threading.Thread(
            target=record_usage, args=(db, key, tenant_id, deployment_id, f"conc-{tenant_id}-{i}")
        )
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.seq for r in chain_of(db, tenant_id)] == list(range(1, 9))
    assert ledger.verify(db, key, tenant_id) == []


def test_an_edited_record_is_found(db, key, make_chain):
    tenant_id = make_chain(3)
    run_sql(
        db,
        "UPDATE usagerecord SET output_tokens = 1 WHERE tenant_id = :t AND seq = 2",
        t=tenant_id,
    )
    assert [(p.seq, p.kind) for p in ledger.verify(db, key, tenant_id)] == [(2, "edited")]


def test_a_deleted_record_is_found(db, key, make_chain):
    tenant_id = make_chain(3)
    run_sql(db, "DELETE FROM usagerecord WHERE tenant_id = :t AND seq = 2", t=tenant_id)
    assert [(p.seq, p.kind) for p in ledger.verify(db, key, tenant_id)] == [(2, "deleted")]


def test_a_deleted_last_record_is_found(db, key, make_chain):
    tenant_id = make_chain(3)
    run_sql(db, "DELETE FROM usagerecord WHERE tenant_id = :t AND seq = 3", t=tenant_id)
    assert [(p.seq, p.kind) for p in ledger.verify(db, key, tenant_id)] == [(3, "deleted")]


def test_an_inserted_record_is_found(db, key, make_chain, deployment_id):
    tenant_id = make_chain(3)
    record_usage(db, key, tenant_id, deployment_id, f"late-{tenant_id}")
    late = chain_of(db, tenant_id)[3]
    # Move the late record in at seq 2, shifting the others up: its link was made for seq 4.
    run_sql(db, "UPDATE usagerecord SET seq = -1 WHERE id = :id", id=late.id)
    for seq in (3, 2):
        run_sql(
            db,
            "UPDATE usagerecord SET seq = seq + 1 WHERE tenant_id = :t AND seq = :s",
            t=tenant_id,
            s=seq,
        )
    run_sql(db, "UPDATE usagerecord SET seq = 2 WHERE id = :id", id=late.id)
    assert [(p.seq, p.kind) for p in ledger.verify(db, key, tenant_id)] == [(2, "edited")]


def test_reordered_records_are_found(db, key, make_chain):
    tenant_id = make_chain(3)
    first, second, _third = chain_of(db, tenant_id)
    # Swap two records whole (their links too): each still matches its own content.
    run_sql(db, "UPDATE usagerecord SET seq = -1 WHERE id = :id", id=first.id)
    run_sql(db, "UPDATE usagerecord SET seq = 1 WHERE id = :id", id=second.id)
    run_sql(db, "UPDATE usagerecord SET seq = 2 WHERE id = :id", id=first.id)
    problems = ledger.verify(db, key, tenant_id)
    assert [(p.seq, p.kind) for p in problems] == [(1, "edited")]


def test_a_rewritten_chain_is_found_by_the_exported_heads(db, key, make_chain, tmp_path):
    tenant_id = make_chain(2)
    export = ledger.export_heads(db, key, tmp_path)
    assert ledger.verify(db, key, tenant_id) == []
    # Rewrite the whole chain with the secret: the chain itself verifies again...
    run_sql(db, "DELETE FROM usagerecord WHERE tenant_id = :t AND seq = 2", t=tenant_id)
    first = chain_of(db, tenant_id)[0]
    run_sql(
        db,
        "UPDATE usagechainhead SET seq = 1, link = :l WHERE tenant_id = :t",
        l=first.link,
        t=tenant_id,
    )
    # ...but not against the heads exported before.
    problems = ledger.verify(db, key, tenant_id)
    assert [(p.seq, p.kind) for p in problems] == [(2, "rewritten")]
    [path] = tmp_path.glob("heads-*.json")
    assert ledger.read_export_file(path) == (export.document, export.signature)
    run_sql(db, "DELETE FROM chainheadexport WHERE id = :id", id=export.id)
    exports = [ledger.read_export_file(path)]
    assert [p.kind for p in ledger.verify(db, key, tenant_id, exports)] == ["rewritten"]
    assert ledger.verify(db, key, tenant_id) == []  # without the shipped file: undetectable


def test_a_forged_export_is_found(db, key, make_chain, tmp_path):
    tenant_id = make_chain(1)
    export = ledger.export_heads(db, key, tmp_path)
    forged = export.document.replace('"seq":1', '"seq":7')
    problems = ledger.verify(db, key, tenant_id, [(forged, export.signature)])
    assert [p.kind for p in problems] == ["export_forged"]
    run_sql(db, "DELETE FROM chainheadexport WHERE id = :id", id=export.id)


def test_without_a_configured_ledger_secret_one_is_generated_once(tmp_path):
    first = Settings(home_dir=tmp_path, ledger_secret=None).ledger_key
    assert len(first) == 64 and (tmp_path / "secrets" / "ledger_secret").exists()
    assert Settings(home_dir=tmp_path, ledger_secret=None).ledger_key == first
    configured = Settings(home_dir=tmp_path, ledger_secret="configured-ledger-secret")
    assert configured.ledger_key == b"configured-ledger-secret"
