"""Every Redis key, stream, consumer group and pub/sub channel name, built here and nowhere else.

Layout (all under the `llmfleet:` prefix):

- `llmfleet:q:{model}:{tenant}`   stream: one per (model, tenant); the API XADDs requests.
- `llmfleet:tenants:{model}`      set: tenants that have a stream for the model.
- consumer group `workers`        on every tenant stream; each worker process is a consumer.
- `llmfleet:req:{request_id}`     pub/sub channel: token, final and error events for one request.
- `llmfleet:cancel:{model}`       pub/sub channel: request ids whose client went away.
- `llmfleet:worker:{worker_id}`   hash with a TTL: a worker's heartbeat, load state, engine stats.
- `llmfleet:capacity:{model}`     sorted set: worker id -> most tokens (prompt + max_tokens) one
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
- `llmfleet:service:{model}`      hash with a TTL: tenant id -> tokens computed for the tenant per
                                  unit of its weight, by every worker of the model (the pool's
                                  fair-queuing counters, `worker/pool_service.py`).
- `llmfleet:authfail:{address}`  string with a TTL: failed authentications from one client
                                  address in the current window (`api/auth_throttle.py`).
- `llmfleet:resume:{request_id}`  sorted set with a TTL: stream id -> lease expiry (unix s); the
                                  resume streams open on the request (`api/resume_slots.py`).
- `llmfleet:resume-tenant:{tenant}` sorted set with a TTL: the same, for all of a tenant's
                                  requests.
- `llmfleet:latency:{model}:{kind}` list: a model's latest TTFT or ITL samples (`kind` = `ttft` or
                                  `itl`), newest first, capped; workers write, `/dashboard` and
                                  `llmfleet status` read (`shared/latency_window.py`).
"""

from __future__ import annotations

PREFIX = "llmfleet"
WORKER_GROUP = "workers"
CONTROL_QUEUE = f"{PREFIX}:control"


def tenant_stream(model: str, tenant: str) -> str:
    return f"{PREFIX}:q:{model}:{tenant}"


def model_tenants(model: str) -> str:
    return f"{PREFIX}:tenants:{model}"


def request_channel(request_id: str) -> str:
    return f"{PREFIX}:req:{request_id}"


def cancel_channel(model: str) -> str:
    return f"{PREFIX}:cancel:{model}"


def worker_heartbeat(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def worker_heartbeat_pattern() -> str:
    return f"{PREFIX}:worker:*"


def model_capacity(model: str) -> str:
    return f"{PREFIX}:capacity:{model}"


def tenant_service(model: str) -> str:
    return f"{PREFIX}:service:{model}"


def tenant_inflight(tenant: str) -> str:
    return f"{PREFIX}:inflight:{tenant}"


def tenant_queued(tenant: str) -> str:
    return f"{PREFIX}:queued:{tenant}"


def tenant_buckets(tenant: str) -> str:
    return f"{PREFIX}:buckets:{tenant}"


def auth_failures(address: str) -> str:
    return f"{PREFIX}:authfail:{address}"


def latency_samples(model: str, kind: str) -> str:
    return f"{PREFIX}:latency:{model}:{kind}"


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
