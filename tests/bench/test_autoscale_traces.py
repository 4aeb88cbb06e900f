"""The autoscaling simulator's traces (bench/autoscale_traces.py): the shapes, the Azure mix,
reading back what was written, gzipped too, and a window of a trace."""

from __future__ import annotations

import random

import pytest

from bench import autoscale_traces as traces
from bench.autoscale_traces import TraceRequest


def test_the_spike_trace_rises_5x_within_a_minute_with_the_azure_mix():
    shape = traces.shape_of("spike", random.Random(0))
    assert shape.rate_per_s(660) / shape.rate_per_s(600) == pytest.approx(5)
    requests = traces.generate("spike", seed=0)
    mean_tokens = sum(r.num_tokens for r in requests) / len(requests)
    assert mean_tokens == pytest.approx(1155 + 211, rel=0.05)  # the Azure 2023 conversation means
    in_spike = sum(900 <= r.arrival_s < 1200 for r in requests) / 300
    assert in_spike == pytest.approx(75, rel=0.05)


def test_the_spike_day_is_a_diurnal_day_with_one_5x_spike_at_two_in_the_afternoon():
    shape = traces.shape_of("spike-day", random.Random(0))
    hour = 3600.0
    day = traces.diurnal(46.0, period_s=24 * hour, trough_at_s=4 * hour)
    assert shape.duration_s == 24 * hour
    # The diurnal cycle: lowest at 04:00, highest at 16:00, peak / trough 2.3.
    assert day(16 * hour) / day(4 * hour) == pytest.approx(2.3)
    assert min(day(h * hour) for h in range(24)) == day(4 * hour)
    # 14:00: ~62 requests a second (10 workers at 80%); 5x a minute later, held 20 minutes,
    # back within a minute; the day's own rate everywhere else.
    assert shape.rate_per_s(14 * hour) == pytest.approx(61.7, abs=0.1)
    for t_s in (14 * hour + 60, 14 * hour + 600, 14 * hour + 1260):
        assert shape.rate_per_s(t_s) / day(t_s) == pytest.approx(5)
    for t_s in (0.0, 10 * hour, 14 * hour, 14 * hour + 1320, 20 * hour):
        assert shape.rate_per_s(t_s) == pytest.approx(day(t_s))


def test_the_diurnal_trace_keeps_its_shape():
    shape = traces.shape_of("diurnal", random.Random(0))
    assert shape.rate_per_s(1800) / shape.rate_per_s(0) == pytest.approx(2.3)
    assert shape.rate_per_s(0) == pytest.approx(20 * (1 - 1.3 / 3.3))


def test_a_trace_is_the_same_for_a_seed_and_reads_back_as_written(tmp_path):
    requests = traces.generate("flash", seed=4)
    assert traces.generate("flash", seed=4) == requests
    assert traces.generate("flash", seed=5) != requests
    path = tmp_path / "flash.csv"
    traces.write_trace(path, requests)
    assert path.read_text().splitlines()[0] == "arrival_s,prompt_tokens,output_tokens"
    assert traces.read_trace(path) == requests
    (tmp_path / "bad.csv").write_text("t,prompt,output\n1,2,3\n")
    with pytest.raises(ValueError, match="header"):
        traces.read_trace(tmp_path / "bad.csv")


def test_a_gzipped_trace_reads_back_as_written(tmp_path):
    requests = traces.generate("ramp", seed=1)
    plain, zipped = tmp_path / "ramp.csv", tmp_path / "ramp.csv.gz"
    traces.write_trace(plain, requests)
    traces.write_trace(zipped, requests)
    assert zipped.read_bytes()[:2] == b"\x1f\x8b"  # gzip's magic
    assert zipped.stat().st_size < plain.stat().st_size / 2
    assert traces.read_trace(zipped) == requests
    # No name nor time in the gzip header: the same trace, the same bytes (the shipped
    # sample can be made again and compared).
    again = tmp_path / "again.csv.gz"
    traces.write_trace(again, requests)
    assert again.read_bytes() == zipped.read_bytes()


def test_a_window_keeps_its_arrivals_with_times_from_its_start():
    requests = [TraceRequest(float(t), 10, 5) for t in range(10)]
    assert traces.window(requests, 3.0, 6.0) == [
        TraceRequest(0.0, 10, 5),
        TraceRequest(1.0, 10, 5),
        TraceRequest(2.0, 10, 5),
    ]
