"""`llmfleet up`: the whole platform on one machine, on embedded defaults.

Starts the embedded Redis (unless REDIS_URL is set), prepares the database, starts the API,
the control process and one worker as child processes (logs under `<home>/logs/`), shows
progress while the model loads, then prints the URL, a development API key, the admin key and
where the metrics token is, and waits for Ctrl-C. Everything it and its children write under
the home is readable by the user only (directories 0700, files 0600).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field

import httpx
import redis
from rich.console import Console
from rich.markup import escape

from cli.redis_server import EmbeddedRedis
from shared import deployments, keys, tenants
from shared.db import create_schema, make_engine
from shared.model_source import DEFAULT_MODEL_ID
from shared.private_files import PRIVATE_UMASK, make_private_dir, open_private_log, touch_private
from shared.settings import Settings

DEV_TENANT = "dev"
START_TIMEOUT_S = 600


@dataclass
class LocalStack:
    settings: Settings
    console: Console = field(default_factory=Console)
    children: list[subprocess.Popen] = field(default_factory=list)
    redis_server: EmbeddedRedis | None = None
    env_overrides: dict[str, str] = field(default_factory=dict)  # for every child

    def start_redis(self) -> None:
        if not self.settings.is_embedded_redis or _answers_ping(self.settings.redis_url):
            return
        self.redis_server = EmbeddedRedis(
            self.settings.home / "redis", unix_socket=self.settings.redis_socket_path
        ).start()

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, **self.env_overrides, "LLMFLEET_HOME_DIR": str(self.settings.home)}
        # The child writes to its own copy of the log's descriptor; ours is closed.
        with open_private_log(self.settings.home / "logs" / f"{name}.log") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "cli", *args],
                stdout=log,
                stderr=log,
                env=env,
                umask=PRIVATE_UMASK,  # what the children write in the home is private too
            )
        self.children.append(process)
        return process

    def stop(self) -> None:
        for process in self.children:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.children:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        if self.redis_server is not None:
            self.redis_server.stop()


def run_local(settings: Settings, *, model: str, batching: str) -> None:
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
            if deployments.get_active(engine, model) is None:
                if model != DEFAULT_MODEL_ID:
                    raise SystemExit(f"no deployment {model!r}; add it with `llmfleet model add`")
                deployments.ensure_default(engine)
            key = _dev_key(settings, engine)
            metrics_token = _metrics_token_source(settings)
        api = stack.spawn("api", "api")
        control = stack.spawn("control", "control")
        worker = stack.spawn("worker", "worker", "--model", model, "--batching", batching)
        _wait_until_ready(stack, api, worker, model)
        _print_ready(console, settings, key, model, metrics_token)
        while all(p.poll() is None for p in (api, control, worker)):
            time.sleep(0.5)
        console.print("[red]a process exited; see the logs under[/red]", settings.home / "logs")
    except KeyboardInterrupt:
        console.print("stopping...")
    finally:
        stack.stop()


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


def _wait_until_ready(
    stack: LocalStack, api: subprocess.Popen, worker: subprocess.Popen, model: str
) -> None:
    settings = stack.settings
    with closing(redis.Redis.from_url(settings.redis_url)) as client:
        _show_progress(stack, api, worker, model, client)


def _show_progress(
    stack: LocalStack, api: subprocess.Popen, worker: subprocess.Popen, model: str, client
) -> None:
    settings = stack.settings
    started = time.monotonic()
    with stack.console.status("") as status:
        while True:
            elapsed = time.monotonic() - started
            if api.poll() is not None or worker.poll() is not None or elapsed > START_TIMEOUT_S:
                raise SystemExit(f"startup failed; see the logs under {settings.home / 'logs'}")
            worker_state = _worker_state(client, worker.pid)
            api_state = "ready" if api_ready(settings) else "starting"
            status.update(
                f"worker ({model}): {worker_state} · api: {api_state} · {elapsed:.0f}s"
                + ("  (loading the model's weights)" if worker_state == "loading" else "")
            )
            if worker_state == "ready" and api_state == "ready":
                return
            time.sleep(0.3)


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
    console: Console, settings: Settings, key: str, model: str, metrics_token: str
) -> None:
    url = f"http://{settings.api_host}:{settings.api_port}"
    console.print(f"\n[bold green]llmfleet is up[/bold green] at [bold]{url}[/bold]")
    console.print(f"development API key: [bold]{key}[/bold]")
    console.print(f"admin key (/admin/v1): [bold]{escape(settings.admin_secret)}[/bold]")
    console.print(f"metrics token (/metrics): {metrics_token}", soft_wrap=True)
    console.print(f"status page: {url}/dashboard (asks for the admin key) · `llmfleet status`")
    console.print(f"logs: {settings.home / 'logs'}\n")
    console.print("try:")
    console.print(
        f"  curl -N {url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
        f'-H \'Content-Type: application/json\' -d \'{{"model": "{model}", "stream": true, '
        f'"messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}\'\n',
        soft_wrap=True,
    )
    console.print("Ctrl-C stops everything.")
