"""The chaos suite: each scenario runs the same load (N streaming requests over three
tenants) on a platform of its own while one fault is injected, then checks, from the
client's log against Redis and SQL, that every request ended exactly once, saw only its own
tokens, without gaps or repeats, was billed once, and that no queue entry stays pending.

`LLMFLEET_CHAOS_REQUESTS` sets the requests per scenario (64 here: 512 in all; `make chaos`
runs 500 each).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

import pytest

from tests.chaos import checks
from tests.chaos.client import LoadClient, make_specs
from tests.chaos.harness import Stack
from tests.helpers import wait_pending_drained

NUM_REQUESTS = int(os.environ.get("LLMFLEET_CHAOS_REQUESTS", "64"))
CONCURRENCY = 24
POISON_TOKEN_ID = 31337
FAULT_WAIT_TIMEOUT_S = 60.0
USAGE_WAIT_TIMEOUT_S = 15.0
# A stuck stream fails the scenario instead of hanging the run.
LOAD_TIMEOUT_S = 120.0 + NUM_REQUESTS

Fault = Callable[[Stack, LoadClient], Awaitable[None]]


async def _when_streaming(client: LoadClient, num: int, api_index: int | None = None) -> None:
    """Wait until `num` requests are mid-generation (on one API, if given)."""
    deadline = time.monotonic() + FAULT_WAIT_TIMEOUT_S
    while client.num_streaming(2, api_index) < num:
        assert time.monotonic() < deadline, "the load never got going"
        await asyncio.sleep(0.02)


async def kill_worker(stack: Stack, client: LoadClient) -> None:
    """kill -9 a worker that is generating (the one serving a request mid-stream). Stopped
    first, so that what it holds at the kill can be read: only those requests may end
    `worker_lost`."""
    await _when_streaming(client, 8)
    with stack.redis() as r:
        worker = await asyncio.to_thread(stack.owner_of, r, client.streaming_request_ids(2))
        worker.send_signal(signal.SIGSTOP)
        stack.held_by_killed = await asyncio.to_thread(stack.requests_owned_by, r, worker.pid)
    worker.kill()
    await asyncio.to_thread(stack.start_worker)


async def sigterm_worker(stack: Stack, client: LoadClient) -> None:
    await _when_streaming(client, 8)
    with stack.redis() as r:
        worker = await asyncio.to_thread(stack.owner_of, r, client.streaming_request_ids(2))
    worker.send_signal(signal.SIGTERM)
    await asyncio.to_thread(stack.start_worker)
    assert await asyncio.to_thread(worker.wait, 60) == 0


async def restart_redis(stack: Stack, client: LoadClient) -> None:
    await _when_streaming(client, 8)
    await asyncio.to_thread(stack.restart_redis, 1.0)


async def cut_worker_connections(stack: Stack, client: LoadClient) -> None:
    """Reset every connection between the workers and Redis twice, 1 s apart, each time
    resetting their reconnects for 0.5 s (Redis itself stays up)."""
    await _when_streaming(client, 8)
    assert stack.proxy is not None
    for _ in range(2):
        stack.proxy.cut(0.5)
        await asyncio.sleep(1.0)


async def _kill_role(stack: Stack, client: LoadClient, role: str) -> None:
    """kill -9 the worker of `role` while requests stream, stopped first so that what it
    holds at the kill can be read (only those may end `worker_lost`); then another. Stopped
    while it holds none (a decode worker between hand-offs: streams begin on the prefill
    worker), it is let go on and stopped again a moment later."""
    await _when_streaming(client, 8)
    worker = stack.live_worker(role)
    deadline = time.monotonic() + FAULT_WAIT_TIMEOUT_S
    with stack.redis() as r:
        while True:
            worker.send_signal(signal.SIGSTOP)
            held = await asyncio.to_thread(stack.requests_owned_by, r, worker.pid)
            if held or time.monotonic() > deadline:
                break
            worker.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.005)
    stack.held_by_killed = held
    worker.kill()
    await asyncio.to_thread(stack.start_worker, role)


async def kill_prefill_worker(stack: Stack, client: LoadClient) -> None:
    """Disaggregated: the prefill worker dies mid-transfer: stopped the moment one of its
    hand-offs is offered and not yet answered, then killed."""
    await _when_streaming(client, 8)
    worker = stack.live_worker("prefill")
    deadline = time.monotonic() + FAULT_WAIT_TIMEOUT_S
    with stack.redis() as r:
        while not (offered := await asyncio.to_thread(stack.offered_hand_offs, r)):
            assert time.monotonic() < deadline, "no hand-off was ever in flight"
            await asyncio.sleep(0.002)
        worker.send_signal(signal.SIGSTOP)
        stack.in_transfer_at_kill = offered
        stack.held_by_killed = await asyncio.to_thread(stack.requests_owned_by, r, worker.pid)
    worker.kill()
    await asyncio.to_thread(stack.start_worker, "prefill")


async def kill_decode_worker(stack: Stack, client: LoadClient) -> None:
    """Disaggregated: the decode worker dies mid-stream, the prefill worker still sending."""
    await _kill_role(stack, client, "decode")


async def cut_kv_link(stack: Stack, client: LoadClient) -> None:
    """Disaggregated: reset every connection to the decode worker's KV endpoint three times,
    1 s apart, each time resetting reconnects for 0.5 s: transfers and their answers lost."""
    await _when_streaming(client, 8)
    assert stack.kv_proxy is not None
    for _ in range(3):
        stack.kv_proxy.cut(0.5)
        await asyncio.sleep(1.0)


async def kill_api(stack: Stack, client: LoadClient) -> None:
    await _when_streaming(client, 4, api_index=0)
    stack.apis[0].kill()


async def pause_subscriber(stack: Stack, client: LoadClient) -> None:
    """SIGSTOP an API process for 3 s while it streams, then SIGCONT: its subscribers fall
    behind, and meanwhile Redis drops them, as it does a subscriber past its
    `client-output-buffer-limit pubsub` (a tiny model's few kB of events never fill the
    kernel's socket buffers, so the limit itself never triggers here: `CLIENT KILL TYPE
    pubsub` does what it would). What was published meanwhile is lost to pub/sub; every
    stream must still end whole, from the journal."""
    await _when_streaming(client, 4, api_index=0)
    stack.apis[0].send_signal(signal.SIGSTOP)
    await asyncio.sleep(1)
    with stack.redis() as r:
        stack.num_subscribers_dropped = await asyncio.to_thread(
            r.client_kill_filter, _type="pubsub"
        )
    await asyncio.sleep(2)
    stack.apis[0].send_signal(signal.SIGCONT)


async def lock_database(stack: Stack, client: LoadClient) -> None:
    """Hold the database's write lock for longer than the writers' busy timeout (1 s in this
    scenario): usage writes fail and the control process retries them later."""
    await _when_streaming(client, 8)
    await asyncio.to_thread(stack.lock_database)
    await asyncio.sleep(4)
    await asyncio.to_thread(stack.unlock_database)


async def no_fault(stack: Stack, client: LoadClient) -> None:
    """The fault is in the requests themselves (disconnects, poison prompts)."""


def _fault_evidence(name: str, stack: Stack, logs: list, states: list[str]) -> str | None:
    """Why the scenario's fault did not show (None: it did), so that a fault that missed
    its moment fails rather than passes vacuously."""
    if name == "worker_kill9" and "failed:worker_lost" not in states:
        return "no request was mid-generation on the killed worker"
    if name == "worker_sigterm" and "failed:worker_shutdown" not in states:
        return "no request outlived the drain timeout"
    if name == "api_kill" and not any(log.num_resumes for log in logs):
        return "no stream was resumed"
    if name == "paused_subscriber" and not stack.num_subscribers_dropped:
        return "no subscriber was dropped"
    if name == "worker_connections_cut" and not stack.proxy.num_cut:
        return "no connection was cut"
    if name == "db_unavailable" and not stack.log_count("control", DB_RETRY):
        return "no usage write failed"
    if name.startswith("disagg_") and not stack.num_handed_off():
        return "no request was handed from the prefill to the decode worker"
    if name in ("disagg_prefill_kill9", "disagg_decode_kill9") and not stack.held_by_killed:
        return "the killed worker held no request"
    if name == "disagg_prefill_kill9" and not stack.in_transfer_at_kill:
        return "no hand-off was in flight when the prefill worker was killed"
    if name == "disagg_kv_link_cut" and not (stack.kv_proxy and stack.kv_proxy.num_cut):
        return "no KV connection was cut"
    return None


# What the control process logs when a usage write failed and will be retried.
DB_RETRY = "not recorded yet (database unavailable)"

SCENARIOS = {
    # name: (fault, error codes a request may end with, make_specs options, process env)
    "worker_kill9": (kill_worker, {"worker_lost"}, {}, {}),
    # A drain timeout shorter than the running requests: unstarted ones are handed back,
    # running ones that do not finish in time end `worker_shutdown` (graceful drains that
    # finish everything: tests/e2e/test_recovery.py).
    "worker_sigterm": (
        sigterm_worker,
        {"worker_shutdown"},
        {},
        {"LLMFLEET_WORKER_DRAIN_TIMEOUT_S": "0.1"},
    ),
    "redis_restart": (restart_redis, set(), {}, {}),
    "worker_connections_cut": (cut_worker_connections, set(), {}, {}),
    "api_kill": (kill_api, set(), {}, {}),
    "client_disconnect": (no_fault, set(), {"disconnect_every": 4}, {}),
    "paused_subscriber": (pause_subscriber, set(), {}, {}),
    "poison_prompt": (
        no_fault,
        {"model_error"},
        {"poison_every": 8, "poison_token_id": POISON_TOKEN_ID},
        {"LLMFLEET_FAULT_TOKEN_ID": str(POISON_TOKEN_ID)},
    ),
    "db_unavailable": (lock_database, set(), {}, {"LLMFLEET_DB_BUSY_TIMEOUT_S": "1"}),
    # Prefill/decode disaggregation (issue 22): a prefill and a decode worker.
    "disagg_prefill_kill9": (kill_prefill_worker, {"worker_lost"}, {}, {}),
    "disagg_decode_kill9": (kill_decode_worker, {"worker_lost"}, {}, {}),
    "disagg_kv_link_cut": (cut_kv_link, set(), {}, {}),
}
DISAGGREGATED = {"worker_roles": ("decode", "prefill")}
STACK_OPTIONS = {
    "worker_connections_cut": {"workers_via_proxy": True},
    "disagg_prefill_kill9": DISAGGREGATED,
    "disagg_decode_kill9": DISAGGREGATED,
    "disagg_kv_link_cut": DISAGGREGATED | {"kv_via_proxy": True},
}


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_chaos(name, chaos_stack, chaos_report):
    fault, allowed_errors, spec_options, extra_env = SCENARIOS[name]
    stack = chaos_stack(extra_env, **STACK_OPTIONS.get(name, {}))
    specs = make_specs(stack.tenants, NUM_REQUESTS, seed=len(name), **spec_options)
    client = LoadClient(stack.api_urls, CONCURRENCY)
    started_s = time.monotonic()
    load = asyncio.create_task(client.run(specs))
    await fault(stack, client)
    done, _ = await asyncio.wait({load}, timeout=LOAD_TIMEOUT_S)
    if not done:
        load.cancel()
        stuck = [(log.request_id, log.event_ids[-1:], log.http_errors[-1:]) for log in client.logs
                 if log.ended_s is None]  # fmt: skip
        pytest.fail(f"{len(stuck)} streams never ended: {stuck[:10]}")
    logs = load.result()
    wall_s = time.monotonic() - started_s

    with stack.redis() as r:
        pending = await asyncio.to_thread(wait_pending_drained, r, stack.tenant_streams())
        usage = await _wait_usage(stack, [log.request_id for log in logs if log.request_id])
        journals = {log.request_id: checks.journal(r, log.request_id) for log in logs}
    states = [checks.final_state(log, _first(usage.get(log.request_id))) for log in logs]
    chaos_report(checks.summary(name, logs, states, wall_s))

    problems = [f"pending entries left: {pending}"] if any(pending.values()) else []
    problems += [f"a process crashed: {crash}" for crash in stack.crashed()]
    if (missed := _fault_evidence(name, stack, logs, states)) is not None:
        problems.append(f"the fault did not hit: {missed}")
    for log in logs:
        rows = usage.get(log.request_id, [])
        problems += checks.check_request(log, journals[log.request_id], rows, allowed_errors)
    lost = {log.request_id for log, state in zip(logs, states, strict=True)
            if state == "failed:worker_lost"}  # fmt: skip
    if stray := lost - stack.held_by_killed:  # a live worker dropped them: never allowed
        problems.append(f"worker_lost for requests the killed worker did not hold: {stray}")
    unknown = set(usage) - {log.request_id for log in logs}
    if len(unknown) > sum(log.num_retries for log in logs):
        problems.append(f"usage of requests no client knows: {sorted(unknown)[:5]}")
    # The processes' own account of the first requests that went wrong, to find the cause.
    bad_ids = list(dict.fromkeys(p.split(":")[0] for p in problems if p.startswith("cmpl-")))
    context = [line for rid in bad_ids[:3] for line in stack.log_lines(rid)]
    assert not problems, "\n".join(problems[:20] + context)


async def _wait_usage(stack: Stack, request_ids: list[str]) -> dict[str, list[checks.UsageRow]]:
    """The usage rows, once every request has one (a cancel is recorded after the client
    left) or the timeout passes."""
    deadline = time.monotonic() + USAGE_WAIT_TIMEOUT_S
    while True:
        usage = await asyncio.to_thread(checks.usage_rows, stack.db_path)
        if all(rid in usage for rid in request_ids) or time.monotonic() > deadline:
            return usage
        await asyncio.sleep(0.2)


def _first(rows: list | None):
    return rows[0] if rows else None
