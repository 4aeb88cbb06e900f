"""Tenants and their API keys. A key is shown once; only its HMAC with the server pepper is stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy.engine import Engine
from sqlmodel import select

from shared.db import session_scope
from shared.tables import ApiKey, Tenant

KEY_PREFIX = "lf-"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's admission limits; None means unlimited (see `Tenant`)."""

    max_requests_in_flight: int | None = None
    max_requests_queued: int | None = None
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_tokens_per_request: int | None = None

    @classmethod
    def of(cls, tenant: Tenant) -> TenantLimits:
        return cls(
            max_requests_in_flight=tenant.max_requests_in_flight,
            max_requests_queued=tenant.max_requests_queued,
            tokens_per_minute=tenant.tokens_per_minute,
            requests_per_minute=tenant.requests_per_minute,
            max_tokens_per_request=tenant.max_tokens_per_request,
        )


@dataclass(frozen=True, slots=True)
class Principal:
    """The tenant a request acts for, resolved from its bearer key."""

    tenant_id: str
    tenant_name: str
    tier: int = 1
    weight: int = 1
    limits: TenantLimits = TenantLimits()


def hash_key(key: str, pepper: bytes) -> str:
    return hmac.new(pepper, key.encode(), hashlib.sha256).hexdigest()


def create_tenant(engine: Engine, name: str, *, tier: int = 1, weight: int = 1) -> Tenant:
    with session_scope(engine) as session:
        tenant = Tenant(name=name, tier=tier, weight=weight)
        session.add(tenant)
        session.commit()
        return tenant


def get_tenant_by_name(engine: Engine, name: str) -> Tenant | None:
    with session_scope(engine) as session:
        return session.exec(select(Tenant).where(Tenant.name == name)).first()


def create_key(engine: Engine, tenant_id: str, pepper: bytes) -> str:
    """Create an API key for the tenant and return it; this is the only time it is seen."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with session_scope(engine) as session:
        session.add(ApiKey(tenant_id=tenant_id, key_hash=hash_key(key, pepper), prefix=key[:8]))
        session.commit()
    return key


def authenticate(engine: Engine, key: str, pepper: bytes) -> Principal | None:
    """The principal for a live key of an enabled tenant, else None."""
    if not key.startswith(KEY_PREFIX):
        return None
    key_hash = hash_key(key, pepper)
    with session_scope(engine) as session:
        row = session.exec(
            select(ApiKey, Tenant)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.key_hash == key_hash)
        ).first()
    if row is None:
        return None
    api_key, tenant = row
    # The lookup was by hash; compare again in constant time so the check itself leaks nothing.
    if not hmac.compare_digest(api_key.key_hash, key_hash):
        return None
    if api_key.revoked_at is not None or tenant.is_disabled:
        return None
    return Principal(
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        tier=tenant.tier,
        weight=tenant.weight,
        limits=TenantLimits.of(tenant),
    )
