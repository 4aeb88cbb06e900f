"""The usage ledger's tamper evidence: one HMAC chain of `UsageRecord`s per tenant.

Each record carries `seq` (1, 2, 3... per tenant, without gaps), `prev_link` (the previous
record's `link`) and `link = HMAC(ledger secret, canonical record + seq + prev_link)`. A
`UsageChainHead` row holds each chain's last (seq, link) and is locked by every append, so
appends to one tenant's chain are serialised even with several writers.

Editing a record breaks its link; deleting one leaves a gap in `seq` (or a chain shorter than
its head); inserting or moving one breaks its link too, since `seq` is part of it, and a
record whose own link holds but that does not follow its predecessor is reordered. Rewriting a whole chain with the
secret is caught by the signed head exports (`export_heads`): a (tenant, seq, link) exported
earlier, and shipped off the box, must still be in the chain.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from shared.db import session_scope
from shared.tables import ChainHeadExport, UsageChainHead, UsageRecord

# The billed fields, in the order they are encoded. Adding one is a new chain format.
CHAINED_FIELDS = (
    "request_id",
    "tenant_id",
    "deployment_id",
    "input_tokens",
    "output_tokens",
    "computed_tokens",
    "finish_reason",
    "arrived_at",
    "finished_at",
)


def _utc_iso(moment: datetime) -> str:
    """Timestamps are stored aware; SQLite gives them back naive (in UTC), PostgreSQL aware.
    Both encode the same."""
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    return moment.isoformat()


def canonical(record: UsageRecord) -> bytes:
    values = {}
    for name in CHAINED_FIELDS:
        value = getattr(record, name)
        values[name] = _utc_iso(value) if isinstance(value, datetime) else value
    return json.dumps(values, sort_keys=True, separators=(",", ":")).encode()


def compute_link(key: bytes, record: UsageRecord, seq: int, prev_link: str) -> str:
    message = canonical(record) + b"|" + str(seq).encode() + b"|" + prev_link.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def lock_chain(session: Session, tenant_id: str) -> None:
    """Take the lock that serialises appends to `tenant_id`'s chain, as the transaction's
    first statement. PostgreSQL: the tenant's row, FOR UPDATE (the head row may not exist
    yet). SQLite: any write takes the database's write lock, and taking it before the first
    read keeps a concurrent append from invalidating this transaction's snapshot."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(
            text("SELECT id FROM tenant WHERE id = :tenant_id FOR UPDATE"),
            {"tenant_id": tenant_id},
        )
    else:
        session.execute(
            text("UPDATE usagechainhead SET seq = seq WHERE tenant_id = :tenant_id"),
            {"tenant_id": tenant_id},
        )


def append(session: Session, key: bytes, record: UsageRecord) -> None:
    """Chain `record` after its tenant's head and move the head; `lock_chain` first."""
    head = session.get(UsageChainHead, record.tenant_id)
    if head is None:
        head = UsageChainHead(tenant_id=record.tenant_id, seq=0, link="")
    record.seq, record.prev_link = head.seq + 1, head.link
    record.link = compute_link(key, record, record.seq, record.prev_link)
    head.seq, head.link = record.seq, record.link
    session.add(record)
    session.add(head)


@dataclass(frozen=True, slots=True)
class Problem:
    """The first thing wrong with one tenant's chain."""

    tenant_id: str
    seq: int
    kind: str  # edited | deleted | inserted | reordered | rewritten | export_forged
    detail: str

    def __str__(self) -> str:
        return f"tenant {self.tenant_id} seq {self.seq}: {self.kind}: {self.detail}"


def verify(
    engine: Engine,
    key: bytes,
    tenant_id: str | None = None,
    exports: list[tuple[str, str]] | None = None,
) -> list[Problem]:
    """Walk every chain (or `tenant_id`'s); at most one problem per tenant, the first found.
    `exports`: (document, signature) pairs from exported head files, checked on top of the
    `ChainHeadExport` rows."""
    with session_scope(engine) as session:
        query = select(UsageRecord).order_by(col(UsageRecord.tenant_id), col(UsageRecord.seq))
        heads_query = select(UsageChainHead)
        exports_query = select(ChainHeadExport)
        if tenant_id is not None:
            query = query.where(UsageRecord.tenant_id == tenant_id)
            heads_query = heads_query.where(UsageChainHead.tenant_id == tenant_id)
        records = session.exec(query).all()
        heads = {h.tenant_id: h for h in session.exec(heads_query).all()}
        stored = [(e.document, e.signature) for e in session.exec(exports_query).all()]
    chains: dict[str, list[UsageRecord]] = {}
    for record in records:
        chains.setdefault(record.tenant_id, []).append(record)
    problems = {}
    for tenant, chain in chains.items():
        problem = _check_chain(key, tenant, chain, heads.get(tenant))
        if problem is not None:
            problems[tenant] = problem
    for document, signature in stored + (exports or []):
        for problem in _check_export(key, document, signature, chains, tenant_id):
            problems.setdefault(problem.tenant_id, problem)
    return sorted(problems.values(), key=lambda p: (p.tenant_id, p.seq))


def _check_chain(
    key: bytes, tenant: str, chain: list[UsageRecord], head: UsageChainHead | None
) -> Problem | None:
    expected_seq, prev_link = 1, ""
    for record in chain:
        if record.seq < expected_seq:
            return Problem(tenant, record.seq, "inserted", f"seq repeated by {record.request_id}")
        if record.seq > expected_seq:
            return Problem(tenant, expected_seq, "deleted", f"seq {expected_seq} is missing")
        if compute_link(key, record, record.seq, record.prev_link) != record.link:
            return Problem(
                tenant,
                record.seq,
                "edited",
                f"{record.request_id} does not match its link (edited, inserted or moved)",
            )
        if record.prev_link != prev_link:
            return Problem(
                tenant,
                record.seq,
                "reordered",
                f"{record.request_id} does not follow seq {record.seq - 1}",
            )
        expected_seq, prev_link = record.seq + 1, record.link
    if head is None or (head.seq, head.link) != (expected_seq - 1, prev_link):
        return Problem(tenant, expected_seq, "deleted", "the chain ends before its head")
    return None


def _check_export(
    key: bytes,
    document: str,
    signature: str,
    chains: dict[str, list[UsageRecord]],
    tenant_id: str | None,
) -> list[Problem]:
    if not hmac.compare_digest(_sign(key, document), signature):
        return [Problem("*", 0, "export_forged", "a head export's signature does not match")]
    problems = []
    for head in json.loads(document)["heads"]:
        if tenant_id is not None and head["tenant_id"] != tenant_id:
            continue
        links = {r.seq: r.link for r in chains.get(head["tenant_id"], [])}
        if links.get(head["seq"]) != head["link"]:
            detail = "differs from the head exported " + json.loads(document)["exported_at"]
            problems.append(Problem(head["tenant_id"], head["seq"], "rewritten", detail))
    return problems


def _sign(key: bytes, document: str) -> str:
    return hmac.new(key, document.encode(), hashlib.sha256).hexdigest()


def export_heads(engine: Engine, key: bytes, heads_dir: Path) -> ChainHeadExport:
    """Sign every chain head; store the document and write it to `heads_dir` to ship."""
    with session_scope(engine) as session:
        heads = session.exec(select(UsageChainHead).order_by(UsageChainHead.tenant_id)).all()
        document = json.dumps(
            {
                "exported_at": datetime.now(UTC).isoformat(),
                "heads": [{"tenant_id": h.tenant_id, "seq": h.seq, "link": h.link} for h in heads],
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        export = ChainHeadExport(document=document, signature=_sign(key, document))
        session.add(export)
        session.commit()
    _write_export(heads_dir, export)
    return export


def _write_export(heads_dir: Path, export: ChainHeadExport) -> None:
    heads_dir.mkdir(parents=True, exist_ok=True)
    path = heads_dir / f"heads-{export.id:08d}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"document": export.document, "signature": export.signature}))
    tmp.replace(path)


def read_export_file(path: Path) -> tuple[str, str]:
    data = json.loads(path.read_text())
    return data["document"], data["signature"]
