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
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.private_files import make_private_dir, touch_private

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
    # HMAC key of the usage ledger's chains and signed head exports (`control/ledger.py`).
    # Without one, a random key is generated once and kept in the home directory (development
    # only). Changing it makes every existing chain fail `llmfleet usage verify`.
    ledger_secret: str | None = Field(default=None, min_length=16)
    # Bearer credential of the `/admin/v1` API. Without one, a random key is generated once
    # and kept in the home directory (development only); `llmfleet admin-key` prints it.
    admin_key: str | None = Field(default=None, min_length=16)
    # Bearer credential Prometheus sends to the API's `/metrics`, which always requires one.
    # Without one, a random token is generated once and kept in the home directory
    # (`<home>/secrets/metrics_token`, development only); set it on every API replica alike.
    metrics_token: str | None = Field(default=None, min_length=16)

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # Reverse proxies whose `X-Forwarded-For` names the client (uvicorn's
    # `forwarded_allow_ips`: comma-separated addresses or networks, or `*`). Unset, no proxy
    # header is believed: the client address is the connection's peer.
    forwarded_allow_ips: str | None = None
    # Failed authentications (a wrong tenant or admin key) one client address may make per
    # window before every request from it that presents a key, valid or not, gets 429 with
    # `Retry-After` until the window ends (`api/auth_throttle.py`). Counted in Redis, so
    # shared by every API replica; 0 turns the throttle off.
    max_num_auth_failures: int = Field(default=30, ge=0)
    auth_failure_window_s: int = Field(default=60, ge=1)
    max_request_body_bytes: int = 1_000_000
    max_stop_strings: int = 4
    max_stop_string_chars: int = 64
    # A text prompt (a completion's `prompt`, or a chat's messages together) longer than this
    # many characters per token of the model's context is refused (400 `prompt_too_long`)
    # before it is tokenized, admission's costliest step (about 1 s per 900 KB). Text runs
    # about 4 characters per token, so a prompt that fits the context never comes near it.
    max_prompt_chars_per_context_token: int = Field(default=16, ge=1)
    # Prompts are tokenized on threads of their own, off the event loop: at most this many at
    # once, and at most `..._per_tenant` of them for one tenant, so one tenant's big prompts
    # can hold neither the event loop nor every tokenizer thread (`api/context.py`).
    max_num_tokenizer_threads: int = Field(default=4, ge=1)
    max_num_tokenizer_threads_per_tenant: int = Field(default=2, ge=1)
    # How long an API replica keeps a model's routing table (its stable version, a rollout's
    # canary and share: SQL) and whether a version has a ready worker (Redis) before it reads
    # them again: every replica applies a rollout's change within this (`api/router.py`).
    routing_cache_s: float = Field(default=1.0, gt=0)
    stream_keepalive_s: float = 15.0
    # A request not started this long after admission fails with `queue_timeout` (no GPU
    # used); one not finished this long after admission ends with finish reason `deadline`.
    request_queue_timeout_s: float = 600.0
    request_timeout_s: float = 1800.0
    # How long an admitted request may hold its tenant's in-flight and queued slots before
    # admission drops it as leaked (an API or worker that crashed never released it).
    request_max_lifetime_s: float = 3600.0
    # Limits a tenant gets when it is created without them (CLI, admin API); 0: unlimited.
    # A limit given at creation, or set later, wins; the other limits start unlimited.
    default_max_requests_in_flight: int = Field(default=64, ge=0)
    default_max_requests_queued: int = Field(default=256, ge=0)

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
    # Each event renews it, so it bounds the silence of a running request, not its length; it
    # is also the life of the request's meta hash (set at enqueue, renewed when a worker pulls
    # it), which must outlast the queue wait (`request_queue_timeout_s`).
    journal_ttl_s: int = 3600
    # For a tenant that keeps no content (`content_retention_days` unset): how long the
    # journal, which holds the output text, and the meta hash outlive the terminal event. A
    # client that lost its connection can resume within it; after it the text is gone from
    # Redis (the append-only file keeps it until Redis next rewrites that file).
    resume_grace_s: int = Field(default=60, ge=1)
    # An API stream that hears nothing this long checks the journal and the worker's heartbeat.
    stream_idle_check_s: float = 1.0
    # Redis connections of one API process: its streams' request channels share this many
    # pub/sub connections (`api/subscriber.py`), and its commands a pool of at most
    # `api_max_num_command_connections` (a command waits for a free one); 16 in all by
    # default, whatever the number of open streams.
    api_num_subscriber_connections: int = Field(default=2, ge=1, le=16)
    api_max_num_command_connections: int = Field(default=14, ge=2)
    # Events one stream holds in the API's memory for its client; beyond that they are
    # dropped there, and the stream reads them from the journal once its client catches up.
    max_num_buffered_events_per_stream: int = Field(default=64, ge=1)
    # A stream whose client has not taken a byte for this long (its socket did not drain) is
    # ended: its request is cancelled (billed for what was computed) and an error event
    # `stream_stalled` and `[DONE]` follow whatever the socket still holds.
    stream_send_timeout_s: float = Field(default=30.0, gt=0)
    # SIGTERM of an API process: how long its open streams may take to finish before each
    # ends with an error event `api_shutdown` (resume it on another replica); their requests
    # run on. `llmfleet api` gives uvicorn longer than this (`api/shutdown.py`).
    shutdown_grace_s: float = Field(default=25.0, ge=0)
    # Resume streams (`GET /v1/requests/{id}/events`) open at once, on one request and on all
    # of one tenant's requests, over every API replica; one more gets 429
    # `resume_streams_per_request_exceeded` / `resume_streams_per_tenant_exceeded` with
    # `Retry-After` (`api/resume_slots.py`). Each holds a socket and a stream's buffer.
    max_num_resume_streams_per_request: int = Field(default=4, ge=1)
    max_num_resume_streams_per_tenant: int = Field(default=64, ge=1)
    # An open resume stream renews its slot every third of this; the slots of an API process
    # that died without releasing them free themselves within it.
    resume_stream_lease_s: float = Field(default=30.0, gt=0)
    # The longest range `GET /v1/usage` reports, in days (both ends included); longer: 400.
    max_usage_report_days: int = Field(default=366, ge=1)
    # SQLite only: how long a writer waits for another's lock before the write fails (the
    # control process then retries the usage job later; `control/jobs.py`).
    db_busy_timeout_s: float = 30.0
    # Canary rollouts (`shared/canary_health.py`): over the samples of the last
    # `rollout_window_s` since the rollout started, with at least `rollout_min_num_samples` on
    # both versions, the canary is rolled back when its TTFT p99 or ITL p99 is above the ratio
    # times the stable version's *and* `rollout_min_latency_excess_ms` above it, or its error
    # rate is more than `rollout_max_error_rate_increase` (a fraction) above the stable's.
    rollout_window_s: float = Field(default=60.0, gt=0)
    rollout_min_num_samples: int = Field(default=20, ge=1)
    rollout_max_ttft_p99_ratio: float = Field(default=1.5, ge=1)
    rollout_max_itl_p99_ratio: float = Field(default=1.5, ge=1)
    rollout_min_latency_excess_ms: float = Field(default=25.0, ge=0)
    rollout_max_error_rate_increase: float = Field(default=0.02, ge=0, le=1)
    # The shared pool (`control/pool_policy.py`): a shared worker moves to another model when
    # that one has at least `pool_min_waiting_per_place` requests waiting per place in the
    # batches serving it, more than (1 + `pool_switch_margin`) times the model it serves,
    # it has served that one `pool_min_dwell_s`, and the backlog outlasts the other model's
    # load (measured; `pool_default_load_s` before the first). Rates over `pool_rate_window_s`.
    pool_min_waiting_per_place: float = Field(default=1.0, gt=0)
    pool_switch_margin: float = Field(default=0.5, ge=0)
    pool_min_dwell_s: float = Field(default=30.0, ge=0)
    pool_default_load_s: float = Field(default=10.0, ge=0)
    pool_rate_window_s: float = Field(default=30.0, gt=0)
    pool_tick_s: float = Field(default=1.0, gt=0)
    # The autoscaler (`control/scaler.py`, policies in `control/scale_policy.py`): off, or
    # `reactive`, `predictive`, `predictive+warm`; `llmfleet up --autoscale` sets it for its
    # control process. Every `autoscale_tick_s` it reads arrivals over `autoscale_rate_window_s`.
    # A worker's capacity in tokens a second (prompt + output) is `autoscale_worker_tokens_per_s`
    # when set, else measured from busy workers (`autoscale_default_worker_tokens_per_s` until
    # then); a request's tokens are measured too (`autoscale_default_tokens_per_request` until
    # then). `autoscale_cold_start_s`: the forecast's horizon, what a new worker takes to serve
    # (provisioning plus load). Workers per model version stay within min and max; the warm
    # pool: `predictive+warm` keeps loaded (serving or standby) at least the fewest serving
    # over the last `autoscale_warm_pool_baseline_s` plus `autoscale_warm_pool`. Scale-down:
    # wanted for `autoscale_scale_down_delay_s` before a worker is parked, parked for
    # `autoscale_standby_quiet_s` before it is stopped. The defaults are
    # `control.scale_policy.PolicyParams`' (tuned in docs/benchmarks.md, "Autoscaling"), but
    # for the most workers: 4 for a local fleet.
    autoscale_policy: Literal["off", "reactive", "predictive", "predictive+warm"] = "off"
    autoscale_tick_s: float = Field(default=2.0, gt=0)
    autoscale_rate_window_s: float = Field(default=10.0, gt=0)
    autoscale_worker_tokens_per_s: float | None = Field(default=None, gt=0)
    autoscale_default_worker_tokens_per_s: float = Field(default=500.0, gt=0)
    autoscale_default_tokens_per_request: float = Field(default=300.0, gt=0)
    autoscale_cold_start_s: float = Field(default=180.0, ge=0)
    autoscale_min_workers: int = Field(default=1, ge=0)
    autoscale_max_workers: int = Field(default=4, ge=1)
    autoscale_warm_pool: int = Field(default=1, ge=0)
    autoscale_scale_down_delay_s: float = Field(default=120.0, ge=0)
    autoscale_standby_quiet_s: float = Field(default=180.0, ge=0)
    autoscale_warm_pool_baseline_s: float = Field(default=1800.0, gt=0)
    # Fault injection, for the chaos tests only: a worker's model step fails whenever its
    # input holds this token id (a "poison" prompt).
    fault_token_id: int | None = None
    # Fault injection, for tests only: a worker waits this long before each engine step, a
    # deliberately slow version (the rollback tests' canary).
    fault_step_delay_ms: float = Field(default=0.0, ge=0)

    log_level: str = "INFO"
    log_format: str = "json"  # "json" (one object per line) | "text"
    # uvicorn's access line, one per request: about 9% of the API's CPU per request under an
    # admission burst (docs/benchmarks.md, session 17); off where a load balancer logs access
    access_log: bool = True

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

    @property
    def metrics_token_path(self) -> Path:
        return self.home / "secrets" / "metrics_token"

    @cached_property
    def metrics_secret(self) -> str:
        """The `/metrics` token in effect: `LLMFLEET_METRICS_TOKEN`, else the generated one."""
        if self.metrics_token:
            return self.metrics_token
        if not self.metrics_token_path.exists():
            _create_once(self.metrics_token_path, secrets.token_urlsafe(32))
        return self.metrics_token_path.read_text().strip()

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
    make_private_dir(path.parent)
    tmp = touch_private(path.with_suffix(f".{os.getpid()}.tmp"))
    tmp.write_text(text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def get_settings() -> Settings:
    return Settings()
