"""The admin credential in the settings: generated once when none is configured, and refused when it looks like a tenant key or is too short."""

from __future__ import annotations

import stat

import pytest
from pydantic import ValidationError

from shared.settings import Settings


def test_without_a_configured_admin_key_one_is_generated_once(tmp_path):
    first = Settings(home_dir=tmp_path, admin_key=None)
    key = first.admin_secret
    assert key.startswith("lfadmin-") and len(key) > 40
    path = tmp_path / "secrets" / "admin_key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Settings(home_dir=tmp_path, admin_key=None).admin_secret == key
    assert Settings(home_dir=tmp_path, admin_key="configured-admin-key").admin_secret == (
        "configured-admin-key"
    )


@pytest.mark.parametrize("value", ["lf-looks-like-a-tenant-key", "short"])
def test_an_admin_key_shaped_like_a_tenant_key_or_too_short_is_refused(value):
    with pytest.raises(ValidationError):
        Settings(admin_key=value)
