"""Tenants and their API keys. A key is shown once; only its HMAC with the server pepper is stored.

A key revoked or a tenant changed here is refused (or served with its new settings) by every
API replica from its next request on: the replicas cache verified principals only for the
principals' epoch that every such change moves (`shared/principals_epoch.py`).
"""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from datetime import datetime

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import col, select

from shared.db import session_scope
from shared.settings import Settings, get_settings
from shared.tables import ApiKey, Tenant, utcnow

KEY_PREFIX = "lf-"
LIMIT_FIELDS = (
    "max_requests_in_flight",
    "max_requests_queued",
    "tokens_per_minute",
    "requests_per_minute",
    "max_tokens_per_request",
)
# What an administrator may change on a tenant (its name and id are fixed).
UPDATABLE_FIELDS = ("tier", "weight", *LIMIT_FIELDS, "content_retention_days", "is_disabled")
# Settings and row ids are SQL INTEGER columns, 32-bit on PostgreSQL.
MAX_SETTING_VALUE = 2**31 - 1
# A hundred years. Far beyond any policy, and far enough from `datetime.max` (year 9999)
# that a request's finish time plus its retention is always a date.
MAX_RETENTION_DAYS = 36_500
# One rule for the admin API and the CLI. Names appear in admin URLs: letters, digits, `.`,
# `_`, `-`; no leading punctuation, so no `..`, `/` or whitespace, newlines included. They
# are unique ignoring case (the `ux_tenant_name_lower` index).
TENANT_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
TENANT_NAME_RULE = (
    "must be 1 to 64 letters, digits, `.`, `_` or `-`, starting with a letter or digit"
)
_TENANT_NAME = re.compile(TENANT_NAME_PATTERN)


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
    content_retention_days: int | None = None  # None: prompts and outputs are not stored


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What may be shown about an API key: never the key, never its hash."""

    id: int
    tenant_id: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def of(cls, row: ApiKey) -> KeyInfo:
        assert row.id is not None
        return cls(row.id, row.tenant_id, row.prefix, row.created_at, row.revoked_at)


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A new key and its description; `key` is seen only here, once."""

    key: str
    info: KeyInfo


class TenantNameTaken(Exception):
    """The name, or the same name in another case, belongs to another tenant."""


class InvalidTenantField(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def hash_key(key: str, pepper: bytes) -> str:
    return hmac.digest(pepper, key.encode(), "sha256").hex()  # OpenSSL's one-shot HMAC


def is_valid_tenant_name(name: object) -> bool:
    return isinstance(name, str) and _TENANT_NAME.fullmatch(name) is not None


def check_tenant_name(name: object) -> None:
    if not is_valid_tenant_name(name):
        raise InvalidTenantField("name", TENANT_NAME_RULE)


def default_limits(settings: Settings) -> TenantLimits:
    """What a tenant created without limits gets: `Settings.default_max_requests_in_flight`
    and `default_max_requests_queued` (0: unlimited); no rate limits."""
    return TenantLimits(
        max_requests_in_flight=settings.default_max_requests_in_flight or None,
        max_requests_queued=settings.default_max_requests_queued or None,
    )


def limits_with_defaults(given: Mapping[str, int | None], settings: Settings) -> TenantLimits:
    """The limits the operator gave, by field (None: unlimited), and the defaults for the
    others: how the admin API and the CLI fill in a new tenant's limits."""
    return replace(default_limits(settings), **given)


def retention_days_in_range(days: int) -> int:
    """A stored retention within 0..`MAX_RETENTION_DAYS`: a value written before the cap
    (or straight into SQL) keeps its tenant's usage recordable."""
    return min(max(days, 0), MAX_RETENTION_DAYS)


def check_tenant_fields(fields: Mapping[str, object]) -> None:
    """Raise InvalidTenantField unless every field is updatable and its value in range:
    tier >= 0, weight >= 1, each limit >= 1 or None (unlimited), content_retention_days
    1..`MAX_RETENTION_DAYS` or None (not stored), is_disabled a bool."""
    for field, value in fields.items():
        if (problem := _field_problem(field, value)) is not None:
            raise InvalidTenantField(field, problem)


def _field_problem(field: str, value: object) -> str | None:
    if field not in UPDATABLE_FIELDS:
        return "is not a tenant setting"
    if field == "is_disabled":
        return None if isinstance(value, bool) else "must be true or false"
    if field in LIMIT_FIELDS and value is None:
        return None  # unlimited
    if field == "content_retention_days" and value is None:
        return None  # prompts and outputs not stored
    low = 0 if field == "tier" else 1
    high = MAX_RETENTION_DAYS if field == "content_retention_days" else MAX_SETTING_VALUE
    if _is_int_in(value, low, high):
        return None
    return f"must be an integer from {low} to {high}"


def _is_int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def create_tenant(
    engine: Engine,
    name: str,
    *,
    tier: int = 1,
    weight: int = 1,
    limits: TenantLimits | None = None,
    content_retention_days: int | None = None,
) -> Tenant:
    """Create a tenant; `limits` are kept as given (None fields: unlimited), and left out
    they are `default_limits`. InvalidTenantField for a bad name or value; TenantNameTaken
    if the name is in use in any case (a unique index on lower(name) decides races)."""
    check_tenant_name(name)
    if limits is None:
        limits = default_limits(get_settings())
    settings = {"tier": tier, "weight": weight, "content_retention_days": content_retention_days}
    check_tenant_fields({**settings, **asdict(limits)})
    with session_scope(engine) as session:
        tenant = Tenant(
            name=name,
            tier=tier,
            weight=weight,
            content_retention_days=content_retention_days,
            **asdict(limits),
        )
        session.add(tenant)
        try:
            session.commit()
        except IntegrityError:
            raise TenantNameTaken(name) from None
        return tenant


def get_tenant_by_name(engine: Engine, name: str) -> Tenant | None:
    with session_scope(engine) as session:
        return session.exec(select(Tenant).where(Tenant.name == name)).first()


def list_tenants(engine: Engine) -> list[Tenant]:
    with session_scope(engine) as session:
        return list(session.exec(select(Tenant).order_by(Tenant.name)))


def update_tenant(engine: Engine, name: str, **changes: object) -> Tenant | None:
    """Set any of `UPDATABLE_FIELDS` (a limit set to None becomes unlimited) and bump
    `updated_at`; None if there is no such tenant. Every API replica sees the change on the
    tenant's next request."""
    check_tenant_fields(changes)
    with session_scope(engine) as session:
        tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
        if tenant is None or not changes:
            return tenant
        for field, value in changes.items():
            setattr(tenant, field, value)
        tenant.updated_at = utcnow()
        session.add(tenant)
        session.commit()
        return tenant


def disable_tenant(engine: Engine, name: str) -> Tenant | None:
    """Refuse every key of the tenant from now on (its keys are kept, not revoked)."""
    return update_tenant(engine, name, is_disabled=True)


def enable_tenant(engine: Engine, name: str) -> Tenant | None:
    return update_tenant(engine, name, is_disabled=False)


def issue_key(engine: Engine, tenant_id: str, pepper: bytes) -> IssuedKey:
    """Create an API key for the tenant; the returned key is the only time it is seen."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(tenant_id=tenant_id, key_hash=hash_key(key, pepper), prefix=key[:8])
    with session_scope(engine) as session:
        session.add(row)
        session.commit()
        return IssuedKey(key, KeyInfo.of(row))


def create_key(engine: Engine, tenant_id: str, pepper: bytes) -> str:
    """Create an API key for the tenant and return it; this is the only time it is seen."""
    return issue_key(engine, tenant_id, pepper).key


def list_keys(engine: Engine, tenant_id: str) -> list[KeyInfo]:
    """The tenant's keys, revoked ones included, oldest first."""
    with session_scope(engine) as session:
        rows = session.exec(
            select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(col(ApiKey.id))
        )
        return [KeyInfo.of(row) for row in rows]


def revoke_key(engine: Engine, key_id: int) -> KeyInfo | None:
    """Revoke a key for good; None if there is no such key (an id out of the column's range
    included). Revoking twice keeps the first time. Every API replica refuses the key from
    its next request on."""
    if not _is_int_in(key_id, 1, MAX_SETTING_VALUE):
        return None  # the driver would fail on it (SQLite: 64-bit, PostgreSQL: 32-bit)
    with session_scope(engine) as session:
        row = session.get(ApiKey, key_id)
        if row is None:
            return None
        if row.revoked_at is None:
            row.revoked_at = utcnow()
            session.add(row)
            session.commit()
        return KeyInfo.of(row)


def authenticate(engine: Engine, key: str, pepper: bytes) -> Principal | None:
    """The principal for a live key of an enabled tenant, else None.

    One indexed SQL lookup per call; the API keeps its answers for the current principals'
    epoch (`api/auth.py`), which the callers of `update_tenant` and `revoke_key` move."""
    if not key.startswith(KEY_PREFIX):
        return None
    key_hash = hash_key(key, pepper)
    with session_scope(engine) as session:
        row = session.exec(
            select(ApiKey, Tenant)
            .join(Tenant, col(Tenant.id) == ApiKey.tenant_id)
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
        content_retention_days=tenant.content_retention_days,
    )
