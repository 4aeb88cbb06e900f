"""`llmfleet up`: the whole platform on one machine, on embedded defaults.

Starts the embedded Redis (unless REDIS_URL is set), prepares the database, starts the API,
the control process and the workers as child processes (logs under `<home>/logs/`), shows
progress while the model loads, then prints the URL, a development API key, the admin key and
where the metrics token is. From then on it supervises the children (`cli/supervisor.py`):
one that exits is started again with backoff, each exit and start reported on the console
and in `<home>/logs/up.log`, and their state is published for `llmfleet status` and
`/dashboard` (`shared/supervised.py`). Only Ctrl-C or SIGTERM stops it, and everything with
it. A child that exits before the platform is first up fails the start instead: that is a
configuration to fix, not a crash to ride out. Everything it and its children write under
the home is readable by the user only (directories 0700, files 0600).

The embedded Redis is supervised too: it replays its append-only file when it starts again
(`appendfsync always`: nothing it acknowledged is lost), the workers retry their writes
meanwhile (`LLMFLEET_BROKER_RETRY_S`) and the API answers 503 `broker_unavailable`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import BinaryIO

import httpx
import redis
from rich.console import Console
from rich.markup import escape

from cli.autoscale_actuator import LocalActuator
from cli.redis_server import EmbeddedRedis
from cli.supervisor import Child, Supervisor
from shared import deployments, keys, supervised, tenants
from shared.db import create_schema, make_engine
from shared.model_source import DEFAULT_MODEL_ID
from shared.private_files import PRIVATE_UMASK, make_private_dir, open_private_log, touch_private
from shared.settings import Settings

DEV_TENANT = "dev"
START_TIMEOUT_S = 600
SUPERVISE_INTERVAL_S = 0.5
# Stopping: the workers drain for `worker_drain_timeout_s`, then end what is left; this much
# more before they are killed.
STOP_MARGIN_S = 10.0
# `--` and what follows go to every worker; these `up` sets itself.
OWN_WORKER_OPTIONS = ("--model", "--metrics-port", "--batching", "--standby", "--role")


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    """The local workers: how many, their first metrics port, what else they get."""

    num_workers: int
    first_metrics_port: int  # worker i listens on this plus i; 0: none
    extra_args: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()  # worker i's `--role` (a disaggregated model); (): all `both`

    def metrics_port(self, index: int) -> int:
        return self.first_metrics_port + index if self.first_metrics_port else 0


def check_worker_args(args: list[str]) -> tuple[str, ...]:
    for arg in args:
        if arg.split("=")[0] in OWN_WORKER_OPTIONS:
            raise SystemExit(f"{arg.split('=')[0]} is set by `llmfleet up` itself")
    return tuple(args)


@dataclass
class LocalStack:
    settings: Settings
    console: Console = field(default_factory=Console)
    supervisor: Supervisor = field(init=False)
    redis_child: Child | None = None
    env_overrides: dict[str, str] = field(default_factory=dict)  # for every child
    _log: BinaryIO | None = None

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.report)

    def report(self, message: str) -> None:
        """An exit or a restart: on the console and in `<home>/logs/up.log`."""
        self.console.print(f"[yellow]{escape(message)}[/yellow]", soft_wrap=True)
        if self._log is None:
            self._log = open_private_log(self.settings.home / "logs" / "up.log")
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._log.write(f"{stamp} {message}\n".encode())
        self._log.flush()

    def start_redis(self) -> None:
        if not self.settings.is_embedded_redis or _answers_ping(self.settings.redis_url):
            return
        server = EmbeddedRedis(
            self.settings.home / "redis", unix_socket=self.settings.redis_socket_path
        )
        self.redis_child = self.supervisor.add(Child("redis", lambda: server.start().process))

    def spawn(self, name: str, *args: str, metrics_port: int | None = None) -> Child:
        start = functools.partial(self._popen, name, args)
        return self.supervisor.add(Child(name, start, metrics_port=metrics_port))

    def _popen(self, name: str, args: tuple[str, ...]) -> subprocess.Popen:
        env = {**os.environ, **self.env_overrides, "LLMFLEET_HOME_DIR": str(self.settings.home)}
        # The child writes to its own copy of the log's descriptor; ours is closed. Appended
        # to: a restarted child's log follows what its predecessor wrote before it died.
        with open_private_log(self.settings.home / "logs" / f"{name}.log") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "cli", *args],
                stdout=log,
                stderr=log,
                env=env,
                umask=PRIVATE_UMASK,  # what the children write in the home is private too
            )

    def exited(self) -> list[str]:
        """The children that are not running (before `supervise`, nothing restarts them)."""
        return [c.name for c in self.supervisor.children if _has_exited(c)]

    def supervise(self, actuator: LocalActuator | None = None) -> None:
        """Until Ctrl-C or SIGTERM: restart what exits, publish the children's state, and
        start or stop workers as the autoscaler wants (`actuator`)."""
        with closing(_redis_client(self.settings)) as client:
            while True:
                self.supervisor.tick()
                _publish(client, self.supervisor)
                if actuator is not None:
                    with contextlib.suppress(redis.RedisError, OSError):
                        actuator.tick(client)
                time.sleep(SUPERVISE_INTERVAL_S)

    def retire(self, child: Child) -> None:
        """Stop a worker for good (a scale-down), within its drain."""
        grace_s = self.settings.worker_drain_timeout_s + STOP_MARGIN_S
        self.supervisor.retire(child, grace_s)

    def stop(self) -> None:
        grace_s = self.settings.worker_drain_timeout_s + STOP_MARGIN_S
        self.supervisor.stop(grace_s, last=self.redis_child)
        if self._log is not None:
            self._log.close()


def run_local(
    settings: Settings,
    *,
    model: str,
    batching: str,
    workers: WorkerPlan,
    autoscale: str | None = None,
) -> None:
    # Every file this process writes under the home (secrets, the database) is 0600 and
    # every directory 0700, whichever module creates it: the home holds prompts and keys.
    os.umask(PRIVATE_UMASK)
    make_private_dir(settings.home)
    stack = LocalStack(settings)
    console = stack.console
    # Ctrl-C and SIGTERM stop the children. SIGINT explicitly too: a shell's background job
    # starts with SIGINT ignored, and Python then installs no handler of its own.
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        with console.status("starting Redis and the database...") as status:
            stack.start_redis()
            engine = make_engine(settings)
            create_schema(engine)
            status.update(f"registering model {model}...")
            if deployments.get_stable(engine, model) is None:
                if model != DEFAULT_MODEL_ID:
                    raise SystemExit(f"no deployment {model!r}; add it with `llmfleet model add`")
                deployments.ensure_default(engine)
            key = _dev_key(settings, engine)
            metrics_token = _metrics_token_source(settings)
            deployment = deployments.get_stable(engine, model)
            assert deployment is not None  # registered above
        api = stack.spawn("api", "api")
        if autoscale is None:
            stack.spawn("control", "control")
        worker_children = _spawn_workers(stack, model, batching, workers)
        started_s = time.monotonic()
        _wait_until_ready(stack, api, worker_children, model)
        actuator = None
        if autoscale is not None:
            # The control process runs the autoscaler: started once a worker's cold start
            # here is measured, the forecast's horizon unless one is configured.
            cold_start_s = _autoscale_env(stack, autoscale, time.monotonic() - started_s)
            stack.spawn("control", "control")
            actuator = _actuator(stack, deployment.name, model, batching, workers, worker_children)
        if autoscale is not None:  # before "is up": whoever waits for that reads this too
            console.print(
                f"autoscaling ({autoscale}): {settings.autoscale_min_workers} to "
                f"{settings.autoscale_max_workers} workers, a cold start of {cold_start_s:.0f} s"
            )
        _print_ready(console, settings, key, model, metrics_token, worker_children)
        stack.supervise(actuator)
    except KeyboardInterrupt:
        console.print("stopping...")
    finally:
        stack.stop()


def _spawn_workers(stack: LocalStack, model: str, batching: str, plan: WorkerPlan) -> list[Child]:
    return [_spawn_worker(stack, model, batching, plan, i) for i in range(plan.num_workers)]


def _spawn_worker(
    stack: LocalStack, model: str, batching: str, plan: WorkerPlan, index: int, *own: str
) -> Child:
    port = plan.metrics_port(index)
    args = ["worker", "--model", model, "--batching", batching, "--metrics-port", str(port), *own]
    if plan.roles:
        args += ["--role", plan.roles[index]]
    return stack.spawn(f"worker-{index}", *args, *plan.extra_args, metrics_port=port or None)


def _autoscale_env(stack: LocalStack, policy: str, measured_cold_start_s: float) -> float:
    """The control process's autoscaling settings; the cold start in effect."""
    stack.env_overrides["LLMFLEET_AUTOSCALE_POLICY"] = policy
    if "LLMFLEET_AUTOSCALE_COLD_START_S" in os.environ:
        return stack.settings.autoscale_cold_start_s
    cold_start_s = math.ceil(measured_cold_start_s)
    stack.env_overrides["LLMFLEET_AUTOSCALE_COLD_START_S"] = str(cold_start_s)
    return cold_start_s


def _actuator(
    stack: LocalStack,
    name: str,
    model: str,
    batching: str,
    plan: WorkerPlan,
    workers: list[Child],
) -> LocalActuator:
    """The autoscaler's local hands: new workers start parked, the autoscaler wakes them."""
    settings = stack.settings
    return LocalActuator(
        name,
        settings.autoscale_min_workers,
        settings.autoscale_max_workers,
        spawn_worker=lambda i: _spawn_worker(stack, model, batching, plan, i, "--standby"),
        retire=stack.retire,
        workers=list(workers),
    )


def _redis_client(settings: Settings) -> redis.Redis:
    # Short timeouts: supervising must not hang on a broker that is itself being restarted.
    return redis.Redis.from_url(settings.redis_url, socket_timeout=1, socket_connect_timeout=1)


def _publish(client: redis.Redis, supervisor: Supervisor) -> None:
    # Redis may be down (the embedded one restarting): the next tick writes it all.
    with contextlib.suppress(redis.RedisError, OSError):
        supervised.write(client, supervisor.states())


def _raise_keyboard_interrupt(*_args) -> None:
    raise KeyboardInterrupt


def _metrics_token_source(settings: Settings) -> str:
    """Where the `/metrics` token is, generating it now if it is ours to generate, so that
    Prometheus can be pointed at the file before the first scrape."""
    if settings.metrics_token:
        return "LLMFLEET_METRICS_TOKEN"
    _ = settings.metrics_secret  # creates the file
    return str(settings.metrics_token_path)


def _dev_key(settings: Settings, engine) -> str:
    """The development key, kept in the home directory so that `up` can print it every time."""
    path = settings.home / "secrets" / "dev_api_key"
    if path.exists():
        key = path.read_text().strip()
        if tenants.authenticate(engine, key, settings.pepper) is not None:
            return key
    tenant = tenants.get_tenant_by_name(engine, DEV_TENANT) or tenants.create_tenant(
        engine, DEV_TENANT
    )
    key = tenants.create_key(engine, tenant.id, settings.pepper)
    make_private_dir(path.parent)
    touch_private(path).write_text(key)
    return key


def _wait_until_ready(stack: LocalStack, api: Child, workers: list[Child], model: str) -> None:
    with closing(redis.Redis.from_url(stack.settings.redis_url)) as client:
        _show_progress(stack, api, workers, model, client)


def _show_progress(
    stack: LocalStack, api: Child, workers: list[Child], model: str, client: redis.Redis
) -> None:
    settings = stack.settings
    started = time.monotonic()
    with stack.console.status("") as status:
        while True:
            elapsed = time.monotonic() - started
            exited = stack.exited()
            if exited or elapsed > START_TIMEOUT_S:
                why = f"{', '.join(exited)} exited" if exited else "timed out"
                raise SystemExit(
                    f"startup failed ({why}); see the logs under {settings.home / 'logs'}"
                )
            states = [_worker_state(client, w.process.pid) for w in workers if w.process]
            num_ready = states.count("ready")
            api_state = "ready" if api_ready(settings) else "starting"
            status.update(
                f"workers ({model}): {num_ready}/{len(workers)} ready · api: {api_state} · "
                f"{elapsed:.0f}s"
                + ("  (loading the model's weights)" if "loading" in states else "")
            )
            if num_ready == len(workers) and api_state == "ready":
                return
            time.sleep(0.3)


def _has_exited(child: Child) -> bool:
    return child.process is None or child.process.poll() is not None


def _worker_state(client: redis.Redis, pid: int) -> str:
    for key in client.scan_iter(keys.worker_heartbeat_pattern()):
        info: dict[bytes, bytes] = client.hgetall(key)  # type: ignore[assignment]  # redis-py: sync commands typed Awaitable[T] | T (redis-py#2399)
        if info.get(b"pid") == str(pid).encode():
            return info.get(b"state", b"starting").decode()
    return "starting"


def api_ready(settings: Settings) -> bool:
    try:
        url = f"http://{settings.api_host}:{settings.api_port}/healthz"
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _answers_ping(url: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


def _print_ready(
    console: Console,
    settings: Settings,
    key: str,
    model: str,
    metrics_token: str,
    workers: list[Child],
) -> None:
    url = f"http://{settings.api_host}:{settings.api_port}"
    console.print(f"\n[bold green]llmfleet is up[/bold green] at [bold]{url}[/bold]")
    console.print(f"development API key: [bold]{key}[/bold]")
    console.print(f"admin key (/admin/v1): [bold]{escape(settings.admin_secret)}[/bold]")
    console.print(f"metrics token (/metrics): {metrics_token}", soft_wrap=True)
    console.print(f"status page: {url}/dashboard (asks for the admin key) · `llmfleet status`")
    console.print(f"workers: {_workers_line(workers)}", soft_wrap=True)
    console.print(f"logs: {settings.home / 'logs'}\n")
    console.print("try:")
    console.print(
        f"  curl -N {url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
        f'-H \'Content-Type: application/json\' -d \'{{"model": "{model}", "stream": true, '
        f'"messages": [{{"role": "user", "content": "What is the capital of France? Answer in one word."}}]}}\'\n',
        soft_wrap=True,
    )
    console.print("A process that exits is started again (logs/up.log). Ctrl-C stops everything.")


def _workers_line(workers: list[Child]) -> str:
    """`worker-0 (metrics http://127.0.0.1:9300/metrics), ...`: each worker's own port."""
    return ", ".join(
        f"{w.name} (metrics http://127.0.0.1:{w.metrics_port}/metrics)"
        if w.metrics_port
        else f"{w.name} (no metrics port)"
        for w in workers
    )
