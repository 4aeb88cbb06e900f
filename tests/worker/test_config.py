"""The engine's settings (worker/config.py)."""

from __future__ import annotations

from worker.config import EngineConfig
from worker.echo_engine import build_echo_engine


def test_the_batch_places_are_known_before_the_engine_is_built():
    # A standby worker's telemetry is built before its engine (worker/service.py).
    config = EngineConfig(max_num_seqs=12, num_kv_blocks=8)
    assert config.max_num_seqs_in_batch == build_echo_engine(config, 100).stats().max_num_seqs
    assert config.max_num_seqs_in_batch == 12
    assert EngineConfig(batching="static", max_batch_size=5).max_num_seqs_in_batch == 5
    assert EngineConfig(batching="one").max_num_seqs_in_batch == 1
