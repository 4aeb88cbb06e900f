"""Service as the broker sees it: when each token event of every request was published.

Full-stack scenario runs measure each tenant's service from this, not from when the tokens
reach the benchmark client: on a small machine the API relaying thousands of SSE events a
second delivers them in bursts, and the client shares the cores with the workers. A
subscriber to every request's channel (`keys.request_channel`) in a process of its own
timestamps each event as the broker delivers it, within milliseconds of the worker's
publish. `time.perf_counter()` is the system's monotonic clock on Linux, so its times
compare with the client's.

    python -m bench.service_recorder REDIS_URL OUT.jsonl

Prints `ready` once subscribed; on SIGTERM writes one line per event, `[time_s,
request_id, num_tokens]`, and exits.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import redis

from shared import keys
from shared.protocol import TokenEvent, decode_event

Published = dict[str, list[tuple[float, int]]]  # request id -> (time_s, num_tokens) per event


@contextmanager
def recording(redis_url: str, out: Path) -> Iterator[Published]:
    """Record every token event published while the block runs; the dict is filled on
    exit."""
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.service_recorder", redis_url, str(out)],
        stdout=subprocess.PIPE,
        text=True,
    )
    published: Published = defaultdict(list)
    try:
        if child.stdout is None or child.stdout.readline().strip() != "ready":
            raise RuntimeError("the service recorder did not start")
        yield published
    finally:
        child.terminate()
        child.wait(timeout=60)
    with out.open() as lines:
        for line in lines:
            time_s, request_id, num_tokens = json.loads(line)
            published[request_id].append((time_s, num_tokens))


def main(redis_url: str, out: str) -> None:
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    prefix = keys.request_channel("")
    events: list[tuple[float, str, int]] = []
    with closing(redis.Redis.from_url(redis_url)) as client, client.pubsub() as pubsub:
        pubsub.psubscribe(keys.request_channel("*"))
        pubsub.get_message(timeout=5.0)  # the subscription's confirmation
        print("ready", flush=True)
        while not stopping:
            message = pubsub.get_message(timeout=0.2)
            if message is None or message["type"] != "pmessage":
                continue
            now_s = time.perf_counter()
            event = decode_event(message["data"])
            if isinstance(event, TokenEvent):
                request_id = message["channel"].decode()[len(prefix) :]
                events.append((now_s, request_id, event.num_tokens))
    Path(out).write_text("".join(json.dumps(event) + "\n" for event in events))


if __name__ == "__main__":
    main(*sys.argv[1:3])
