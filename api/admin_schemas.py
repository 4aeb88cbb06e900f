"""Request bodies of the admin API, validated with pydantic.

Strict and closed: `"2"` is not 2, and an unknown (say, misspelt) field is a 400 rather than a
setting silently ignored. In a limit, null means unlimited; a limit left out of a new tenant
takes its default (`shared.tenants.limits_with_defaults`). Names and ranges are those of
`shared.tenants`, which the CLI shares.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from shared.tenants import (
    LIMIT_FIELDS,
    MAX_RETENTION_DAYS,
    MAX_SETTING_VALUE,
    TENANT_NAME_RULE,
    is_valid_tenant_name,
)


def _checked_name(name: str) -> str:
    if not is_valid_tenant_name(name):
        raise ValueError(TENANT_NAME_RULE)  # pydantic reports it as the field's error
    return name


TenantName = Annotated[str, AfterValidator(_checked_name)]
Tier = Annotated[int, Field(ge=0, le=MAX_SETTING_VALUE)]
Weight = Annotated[int, Field(ge=1, le=MAX_SETTING_VALUE)]
Limit = Annotated[int, Field(ge=1, le=MAX_SETTING_VALUE)] | None
RetentionDays = Annotated[int, Field(ge=1, le=MAX_RETENTION_DAYS)] | None


class AdminBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TenantCreateBody(AdminBody):
    name: TenantName
    tier: Tier = 1
    weight: Weight = 1
    max_requests_in_flight: Limit = None
    max_requests_queued: Limit = None
    tokens_per_minute: Limit = None
    requests_per_minute: Limit = None
    max_tokens_per_request: Limit = None
    # Days prompts and outputs are kept (at most MAX_RETENTION_DAYS); null: not stored.
    content_retention_days: RetentionDays = None
    create_key: bool = True  # also issue a first API key, shown in the answer once

    def given_limits(self) -> dict[str, int | None]:
        """The limits the body names (null: unlimited); the others take their defaults."""
        return self.model_dump(include=set(LIMIT_FIELDS), exclude_unset=True)


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
    content_retention_days: RetentionDays = None
    is_disabled: bool | None = None

    def changes(self) -> dict[str, object]:
        return self.model_dump(exclude_unset=True)


class RolloutStartBody(AdminBody):
    """`POST /admin/v1/models/{model}/rollout`; ranges are `shared.rollouts.start`'s."""

    version: Annotated[str, Field(min_length=1, max_length=200)]
    percent: Annotated[float, Field(gt=0, le=100)]
    step_percent: Annotated[float, Field(ge=0, le=100)] = 0.0  # 0: held until promoted
    interval_s: Annotated[float, Field(ge=1, le=86_400)] = 60.0
    sticky: Literal["none", "tenant", "user"] = "none"
    # Requests each version needs in the window before the canary is judged; null: the
    # setting (`LLMFLEET_ROLLOUT_MIN_NUM_SAMPLES`).
    min_num_samples: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
