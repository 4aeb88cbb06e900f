"""Typed configuration from the environment, in one place.

`REDIS_URL` and `DATABASE_URL` keep their conventional names; everything else is
prefixed `LLMFLEET_`. Without `REDIS_URL` the processes talk to the embedded
redis-server on a unix socket under the home directory; without `DATABASE_URL`
they use SQLite there.
"""

from __future__ import annotations

import os
import secrets
from functools import cached_property
from pathlib import Path

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ADMIN_KEY_PREFIX = "lfadmin-"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLMFLEET_", extra="ignore")

    home_dir: Path = Path(".llmfleet")
    redis_url_env: str | None = Field(default=None, validation_alias=AliasChoices("REDIS_URL"))
    database_url_env: str | None = Field(
        default=None, validation_alias=AliasChoices("DATABASE_URL")
    )
    # Server-side secret mixed into API-key hashes. Without one, a random pepper is
    # generated once and kept in the home directory (development only).
    key_pepper: str | None = None
    # HMAC key of the usage ledger's chains and signed head exports (`shared/ledger.py`).
    # Without one, a random key is generated once and kept in the home directory (development
    # only). Changing it makes every existing chain fail `llmfleet usage verify`.
    ledger_secret: str | None = Field(default=None, min_length=16)
    # Bearer credential of the `/admin/v1` API. Without one, a random key is generated once
    # and kept in the home directory (development only); `llmfleet admin-key` prints it.
    admin_key: str | None = Field(default=None, min_length=16)
    # Bearer credential Prometheus sends to the API's `/metrics` (which names tenants); unset,
    # `/metrics` is open, as is usual on a network only the monitoring system reaches.
    metrics_token: str | None = Field(default=None, min_length=16)

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    max_request_body_bytes: int = 1_000_000
    max_stop_strings: int = 4
    max_stop_string_chars: int = 64
    stream_keepalive_s: float = 15.0
    # A request not started this long after admission fails with `queue_timeout` (no GPU
    # used); one not finished this long after admission ends with finish reason `deadline`.
    request_queue_timeout_s: float = 600.0
    request_timeout_s: float = 1800.0
    # How long an admitted request may hold its tenant's in-flight and queued slots before
    # admission drops it as leaked (an API or worker that crashed never released it).
    request_max_lifetime_s: float = 3600.0

    worker_idle_poll_ms: int = 100
    worker_heartbeat_s: float = 2.0
    # A worker silent this long is dead: its waiting requests go to others, its running ones
    # end with `worker_lost`. Keep it a few heartbeats.
    worker_heartbeat_timeout_s: float = 6.0
    # SIGTERM: how long running requests may take to finish before they end `worker_shutdown`.
    worker_drain_timeout_s: float = 30.0
    # How long a worker retries a write to Redis while it is unreachable (a step's tokens, a
    # finished request's usage, final event and acknowledgement); the batch waits meanwhile.
    # After that a finished request is ended by recovery, and a worker that cannot publish a
    # step exits (its running requests end `worker_lost`).
    broker_retry_s: float = 60.0
    # How long a request's journal (its events, for resume and recovery) outlives its last event.
    journal_ttl_s: int = 3600
    # An API stream that hears nothing this long checks the journal and the worker's heartbeat.
    stream_idle_check_s: float = 1.0
    # SQLite only: how long a writer waits for another's lock before the write fails (the
    # control process then retries the usage job later; `shared/control.py`).
    db_busy_timeout_s: float = 30.0
    # Fault injection, for the chaos tests only: a worker's model step fails whenever its
    # input holds this token id (a "poison" prompt).
    fault_token_id: int | None = None

    log_level: str = "INFO"
    log_format: str = "json"  # "json" (one object per line) | "text"

    @property
    def home(self) -> Path:
        return self.home_dir.resolve()

    @property
    def redis_socket_path(self) -> Path:
        return self.home / "redis" / "redis.sock"

    @property
    def is_embedded_redis(self) -> bool:
        return self.redis_url_env is None

    @property
    def redis_url(self) -> str:
        if self.redis_url_env:
            return self.redis_url_env
        return f"unix://{self.redis_socket_path}"

    @property
    def database_url(self) -> str:
        if self.database_url_env:
            return _with_psycopg_driver(self.database_url_env)
        return f"sqlite:///{self.home / 'llmfleet.db'}"

    @cached_property
    def pepper(self) -> bytes:
        if self.key_pepper:
            return self.key_pepper.encode()
        path = self.home / "secrets" / "key_pepper"
        if not path.exists():
            _create_once(path, secrets.token_hex(32))
        return path.read_text().strip().encode()

    @cached_property
    def ledger_key(self) -> bytes:
        if self.ledger_secret:
            return self.ledger_secret.encode()
        path = self.home / "secrets" / "ledger_secret"
        if not path.exists():
            _create_once(path, secrets.token_hex(32))
        return path.read_text().strip().encode()

    @property
    def ledger_heads_dir(self) -> Path:
        """Where signed chain-head exports are written, for an operator to ship off the box."""
        return self.home / "ledger" / "heads"

    @cached_property
    def admin_secret(self) -> str:
        """The admin key in effect: `LLMFLEET_ADMIN_KEY`, else the generated local one."""
        if self.admin_key:
            return self.admin_key
        path = self.home / "secrets" / "admin_key"
        if not path.exists():
            _create_once(path, ADMIN_KEY_PREFIX + secrets.token_urlsafe(32))
        return path.read_text().strip()

    @field_validator("admin_key")
    @classmethod
    def _not_a_tenant_key(cls, value: str | None) -> str | None:
        # Tenant keys all start with `lf-` (shared.tenants.KEY_PREFIX); an admin key that did
        # too could be mistaken for one, so the two credentials never share a shape.
        if value is not None and value.startswith("lf-"):
            raise ValueError("must not start with `lf-`, the prefix of tenant keys")
        return value


def _with_psycopg_driver(url: str) -> str:
    """`postgresql://` means psycopg 3 here, not SQLAlchemy's psycopg2 default."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def _create_once(path: Path, text: str) -> None:
    """Atomically create a private file; a concurrent process that loses the race keeps ours."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def get_settings() -> Settings:
    return Settings()
