"""A standby worker's activation on this machine, with and without the model loaded first:
`python -m bench.activation [--json PATH]`.

Loads the default model's weights as `llmfleet worker --standby` does (`worker/weights.py`),
then times building the engine over them (the KV pool and the forward's state: what an
activation does before the worker serves) three times, with the worker's default engine
options, releasing the engine between tries as a parked worker does.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shared.model_source import DEFAULT_MODEL_ID
from worker.config import DEFAULT_ENGINE
from worker.weights import build_engine, import_loaders, load_weights, release_engine_memory


def measure(num_tries: int = 3) -> dict:
    import_loaders(DEFAULT_ENGINE)
    started_s = time.perf_counter()
    weights = load_weights(
        DEFAULT_MODEL_ID, Path(".llmfleet/cache"), DEFAULT_ENGINE, "auto", "auto"
    )
    load_s = time.perf_counter() - started_s
    activations_s: list[float] = []
    num_blocks: int | None = None
    for _ in range(num_tries):
        started_s = time.perf_counter()
        engine = build_engine(weights, DEFAULT_ENGINE)
        activations_s.append(time.perf_counter() - started_s)
        num_blocks = engine.stats().kv_cache_blocks
        del engine
        release_engine_memory(weights)
    return {"model": DEFAULT_MODEL_ID, "load_s": load_s, "activation_s": activations_s,
            "num_kv_blocks": num_blocks}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    result = measure()
    print(json.dumps(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
