"""Every Redis key, stream, consumer group and pub/sub channel name, built here and nowhere else.

`{deployment}` is one version of a model, named `model@version` (`shared/routing.py`): each
version has its own queues, workers and figures, so queues of different versions never mix.

Layout (all under the `llmfleet:` prefix):

- `llmfleet:q:{deployment}:{tenant}` stream: one per (model version, tenant); the API XADDs
                                  requests.
- `llmfleet:tenants:{deployment}` set: tenants that have a stream for the model version.
- consumer group `workers`        on every tenant stream; each worker process is a consumer.
- `llmfleet:req:{request_id}`     pub/sub channel: token, final and error events for one request.
- `llmfleet:cancel:{model}`       pub/sub channel: request ids whose client went away, for every
                                  version of the model (a worker ignores ids it does not hold).
- `llmfleet:worker:{worker_id}`   hash with a TTL: a worker's heartbeat, load state, engine stats,
                                  the model, version and deployment id it serves.
- `llmfleet:ready:{deployment}`   sorted set: worker id -> unix time of its last heartbeat as a
                                  ready worker of the version; the API routes to a version only
                                  while one is recent (`api/router.py`).
- `llmfleet:capacity:{deployment}` sorted set: worker id -> most tokens (prompt + max_tokens) one
                                  sequence can hold in that worker's KV cache.
- `llmfleet:inflight:{tenant}`    sorted set: request id -> expiry (unix s); admitted, not finished.
- `llmfleet:queued:{tenant}`      sorted set: request id -> expiry (unix s); admitted, not pulled.
- `llmfleet:buckets:{tenant}`     hash with a TTL: the tenant's requests- and tokens-per-minute
                                  token buckets (`shared/quota.py`).
- `llmfleet:events:{request_id}`  stream with a TTL: the request's journal, every event in order,
                                  entry id `0-{seq + 1}` (`shared/journal.py`).
- `llmfleet:done:{request_id}`    string with a TTL: set with the journal's terminal event; no
                                  event is appended after it.
- `llmfleet:dead:{model}`         stream (capped): requests dead-lettered because the model
                                  failed on them alone, with the error, for operators.
- `llmfleet:request:{request_id}` hash with a TTL: tenant, model, kind, created, and the worker
                                  that owns it once pulled; resume and recovery read it.
- `llmfleet:control`             sorted set: arq's queue of control-process jobs (usage events);
                                  arq keeps each job under its own `arq:job:{id}`,
                                  `arq:result:{id}`, `arq:in-progress:{id}`, `arq:retry:{id}`
                                  keys, with ids `usage:{request_id}` (`shared/usage_jobs.py`).
- `llmfleet:service:{deployment}` hash with a TTL: tenant id -> tokens computed for the tenant per
                                  unit of its weight, by every worker of the model version (the
                                  pool's fair-queuing counters, `worker/pool_service.py`).
- `llmfleet:authfail:{address}`  string with a TTL: failed authentications from one client
                                  address in the current window (`api/auth_throttle.py`).
- `llmfleet:resume:{request_id}`  sorted set with a TTL: stream id -> lease expiry (unix s); the
                                  resume streams open on the request (`api/resume_slots.py`).
- `llmfleet:resume-tenant:{tenant}` sorted set with a TTL: the same, for all of a tenant's
                                  requests.
- `llmfleet:latency:{deployment}:{kind}` list: a model version's latest samples (`kind` = `ttft`
                                  or `itl`, seconds; `failed`, 1 or 0 per finished request),
                                  newest first, capped; workers write, `/dashboard`, `llmfleet
                                  status` and the rollout loop read (`shared/latency_window.py`).
- `llmfleet:up`                   hash with a TTL: process name -> its state (pid, restarts, last
                                  exit, up since), written by `llmfleet up` for the processes it
                                  supervises; `/dashboard` and `llmfleet status` read
                                  (`shared/supervised.py`).
- `llmfleet:pool:assignments`     hash: shared-pool worker id -> JSON `{"model", "at"}`, the model
                                  the control process assigned it and since when
                                  (`control/pool.py`); each shared worker follows its own.
- `llmfleet:arrivals:{deployment}:{bucket}` hash with a TTL: requests admitted to a model
                                  version in one `ARRIVAL_BUCKET_S` bucket (`bucket` = its start,
                                  unix s), fields `requests` and `prompt_tokens`; the API's
                                  enqueue script counts, the autoscaler reads (`control/scaler.py`).
- `llmfleet:autoscale:{deployment}` hash: the autoscaler's latest decision for a model version
                                  (policy, workers wanted ready and on standby, forecast); the
                                  local actuator (`llmfleet up --autoscale`) and KEDA read it.
- `llmfleet:handoff:{request_id}`  hash with a TTL: a prefill/decode hand-off of the request
                                  (`shared/handoff.py`): `sender`, `receiver` (worker ids) and
                                  `state` (`offered`, `accepted`, `withdrawn`); exactly one of
                                  sender and receiver holds the request once it is settled.
- `llmfleet:decoders:{deployment}` sorted set: decode worker id -> its free KV blocks, as of
                                  its last heartbeat; prefill workers pick receivers from it.
- `llmfleet:autoscale:roles`      hash: worker id -> `active` or `standby`, as the autoscaler
                                  wants it; a worker without an entry keeps the role it started
                                  with (`llmfleet worker --standby`).
"""

from __future__ import annotations

PREFIX = "llmfleet"
VERSION_SEPARATOR = "@"
WORKER_GROUP = "workers"
CONTROL_QUEUE = f"{PREFIX}:control"
SUPERVISED_PROCESSES = f"{PREFIX}:up"
POOL_ASSIGNMENTS = f"{PREFIX}:pool:assignments"
AUTOSCALE_ROLES = f"{PREFIX}:autoscale:roles"
ARRIVAL_BUCKET_S = 5


def deployment_name(model_id: str, version: str) -> str:
    """`model@version`: one version of a model, in keys, metrics and logs, and as a client
    pins it (`model` = `id@version`)."""
    return f"{model_id}{VERSION_SEPARATOR}{version}"


def split_deployment_name(name: str) -> tuple[str, str | None]:
    """`model@version` as (model id, version); a bare model id as (model id, None)."""
    model_id, separator, version = name.partition(VERSION_SEPARATOR)
    return (model_id, version) if separator else (name, None)


def tenant_stream(deployment: str, tenant: str) -> str:
    return f"{PREFIX}:q:{deployment}:{tenant}"


def model_tenants(deployment: str) -> str:
    return f"{PREFIX}:tenants:{deployment}"


def request_channel(request_id: str) -> str:
    return f"{PREFIX}:req:{request_id}"


def cancel_channel(model: str) -> str:
    return f"{PREFIX}:cancel:{model}"


def worker_heartbeat(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def worker_heartbeat_pattern() -> str:
    return f"{PREFIX}:worker:*"


def ready_workers(deployment: str) -> str:
    return f"{PREFIX}:ready:{deployment}"


def model_capacity(deployment: str) -> str:
    return f"{PREFIX}:capacity:{deployment}"


def tenant_service(deployment: str) -> str:
    return f"{PREFIX}:service:{deployment}"


def tenant_inflight(tenant: str) -> str:
    return f"{PREFIX}:inflight:{tenant}"


def tenant_queued(tenant: str) -> str:
    return f"{PREFIX}:queued:{tenant}"


def tenant_buckets(tenant: str) -> str:
    return f"{PREFIX}:buckets:{tenant}"


def auth_failures(address: str) -> str:
    return f"{PREFIX}:authfail:{address}"


# Bumped by every change to a tenant or a key: API replicas drop their cached principals.
PRINCIPALS_EPOCH = f"{PREFIX}:principals:epoch"


def latency_samples(deployment: str, kind: str) -> str:
    return f"{PREFIX}:latency:{deployment}:{kind}"


def request_events(request_id: str) -> str:
    return f"{PREFIX}:events:{request_id}"


def request_done(request_id: str) -> str:
    return f"{PREFIX}:done:{request_id}"


def request_meta(request_id: str) -> str:
    return f"{PREFIX}:request:{request_id}"


def dead_letter(model: str) -> str:
    return f"{PREFIX}:dead:{model}"


def request_resume_streams(request_id: str) -> str:
    return f"{PREFIX}:resume:{request_id}"


def tenant_resume_streams(tenant: str) -> str:
    return f"{PREFIX}:resume-tenant:{tenant}"


def arrivals(deployment: str, bucket_start_s: int) -> str:
    return f"{PREFIX}:arrivals:{deployment}:{bucket_start_s}"


def autoscale_decision(deployment: str) -> str:
    return f"{PREFIX}:autoscale:{deployment}"


def handoff(request_id: str) -> str:
    return f"{PREFIX}:handoff:{request_id}"


def decode_workers(deployment: str) -> str:
    return f"{PREFIX}:decoders:{deployment}"
