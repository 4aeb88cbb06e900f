"""Tenants in SQL (shared/tenants.py): updates, and the default limits a new tenant gets."""

from __future__ import annotations

import uuid

from shared import tenants


def _name() -> str:
    return f"tenants-{uuid.uuid4().hex[:8]}"


def test_update_bumps_updated_at(db):
    tenant = tenants.create_tenant(db, _name())
    updated = tenants.update_tenant(db, tenant.name, weight=2)
    assert updated.updated_at > tenant.updated_at and updated.created_at == tenant.created_at


def test_create_tenant_keeps_explicit_limits_and_defaults_omitted_ones(db, settings):
    explicit = tenants.create_tenant(db, _name(), limits=tenants.TenantLimits())
    assert tenants.TenantLimits.of(explicit) == tenants.TenantLimits()  # all unlimited
    omitted = tenants.create_tenant(db, _name())
    assert tenants.TenantLimits.of(omitted) == tenants.default_limits(settings)
    assert tenants.default_limits(settings).max_requests_in_flight == 64
