"""Request bodies of the admin API, validated with pydantic.

Strict and closed: `"2"` is not 2, and an unknown (say, misspelt) field is a 400 rather than a
setting silently ignored. In a limit, null means unlimited.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from shared.tenants import LIMIT_FIELDS, MAX_SETTING_VALUE, TenantLimits

# Tenant names appear in admin URLs: letters, digits, `.`, `_`, `-`; no leading punctuation.
TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"

Tier = Annotated[int, Field(ge=0, le=MAX_SETTING_VALUE)]
Weight = Annotated[int, Field(ge=1, le=MAX_SETTING_VALUE)]
Limit = Annotated[int, Field(ge=1, le=MAX_SETTING_VALUE)] | None


class AdminBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TenantCreateBody(AdminBody):
    name: str = Field(pattern=TENANT_NAME_PATTERN)
    tier: Tier = 1
    weight: Weight = 1
    max_requests_in_flight: Limit = None
    max_requests_queued: Limit = None
    tokens_per_minute: Limit = None
    requests_per_minute: Limit = None
    max_tokens_per_request: Limit = None
    content_retention_days: Limit = None  # days prompts and outputs are kept; null: not stored
    create_key: bool = True  # also issue a first API key, shown in the answer once

    def limits(self) -> TenantLimits:
        return TenantLimits(**self.model_dump(include=set(LIMIT_FIELDS)))


class TenantUpdateBody(AdminBody):
    """Only the fields present change. A null limit becomes unlimited; a null tier, weight
    or is_disabled is refused (by `shared.tenants.check_tenant_fields`)."""

    tier: Tier | None = None
    weight: Weight | None = None
    max_requests_in_flight: Limit = None
    max_requests_queued: Limit = None
    tokens_per_minute: Limit = None
    requests_per_minute: Limit = None
    max_tokens_per_request: Limit = None
    content_retention_days: Limit = None
    is_disabled: bool | None = None

    def changes(self) -> dict[str, object]:
        return self.model_dump(exclude_unset=True)
