"""bench.workload: deterministic, sorted, bounded workloads."""

from __future__ import annotations

import numpy as np
import pytest

from bench.workload import make_workload

# Small prompts keep these tests fast; the bounds are what is under test, not the sizes.
SMALL = {"prompt_tokens_min": 2, "prompt_tokens_max": 16, "long_prompt_tokens": 64}


def test_same_seed_same_workload_other_seed_differs():
    assert make_workload(50, seed=3, **SMALL) == make_workload(50, seed=3, **SMALL)
    assert make_workload(50, seed=3, **SMALL) != make_workload(50, seed=4, **SMALL)


@pytest.mark.parametrize("arrival", ["poisson", "burst"])
def test_sorted_by_arrival_and_indexed_in_order(arrival):
    workload = make_workload(200, seed=1, arrival=arrival, **SMALL)
    arrivals_s = [spec.arrival_s for spec in workload]
    assert arrivals_s == sorted(arrivals_s)
    assert [spec.index for spec in workload] == list(range(200))
    assert arrivals_s[0] >= 0.0


def test_lengths_and_token_ids_within_bounds():
    workload = make_workload(
        500, seed=2, prompt_tokens_min=5, prompt_tokens_max=9, output_tokens_mean=20.0,
        output_tokens_max=30, vocab_min=100, vocab_max=110,
    )  # fmt: skip
    num_prompt_tokens = {len(spec.prompt_token_ids) for spec in workload}
    assert num_prompt_tokens == set(range(5, 10))  # both ends reachable
    assert all(1 <= spec.max_tokens <= 30 for spec in workload)
    assert any(spec.max_tokens == 30 for spec in workload)  # the cap is hit, not just respected
    token_ids = {t for spec in workload for t in spec.prompt_token_ids}
    assert token_ids <= set(range(100, 110))
    assert all(type(t) is int for t in workload[0].prompt_token_ids)


def test_burst_arrivals_stay_within_window():
    workload = make_workload(300, seed=5, arrival="burst", burst_window_s=0.5, **SMALL)
    assert all(0.0 <= spec.arrival_s <= 0.5 for spec in workload)
    assert workload[-1].arrival_s > 0.4  # spread over the window, not bunched at its start


def test_poisson_mean_gap_is_one_over_rate():
    workload = make_workload(2000, seed=7, arrival="poisson", rate_per_s=20.0, **SMALL)
    mean_gap_s = float(np.mean(np.diff([spec.arrival_s for spec in workload])))
    assert mean_gap_s == pytest.approx(1 / 20.0, rel=0.1)
    assert workload[0].arrival_s == 0.0


def test_long_prompt_fraction_roughly_honoured():
    workload = make_workload(2000, seed=11, long_prompt_fraction=0.25, **SMALL)
    num_long = sum(len(spec.prompt_token_ids) == 64 for spec in workload)
    assert 0.2 * 2000 <= num_long <= 0.3 * 2000
    assert all(len(spec.prompt_token_ids) in (*range(2, 17), 64) for spec in workload)


def test_no_long_prompts_by_default():
    workload = make_workload(200, seed=0, **SMALL)
    assert all(len(spec.prompt_token_ids) <= 16 for spec in workload)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arrival": "closed"},
        {"rate_per_s": 0.0},
        {"prompt_tokens_min": 10, "prompt_tokens_max": 5},
        {"long_prompt_fraction": 1.5},
        {"vocab_min": 10, "vocab_max": 10},
    ],
)
def test_invalid_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        make_workload(10, **kwargs)


def test_a_shared_prefix_starts_every_prompt_and_leaves_the_rest_as_without_it():
    plain = make_workload(20, seed=3)
    shared = make_workload(20, seed=3, shared_prefix_tokens=64)
    prefix = shared[0].prompt_token_ids[:64]
    for without, with_prefix in zip(plain, shared, strict=True):
        assert with_prefix.prompt_token_ids == prefix + without.prompt_token_ids
        assert (with_prefix.arrival_s, with_prefix.max_tokens) == (
            without.arrival_s,
            without.max_tokens,
        )


def test_the_autoscale_ramp_arrives_at_its_rising_rate():
    from bench.autoscale_ramp import arrivals_s
    from bench.load_plan import RampPlan

    plan = RampPlan(start_rate_per_s=1.0, peak_rate_per_s=5.0, ramp_s=100.0, hold_s=50.0)
    times = arrivals_s(plan)
    # The integral: 100 s at a mean of 3 a second, then 50 s at 5.
    assert abs(len(times) - (300 + 250)) <= 2
    first_half = sum(t < 50 for t in times)
    second_half = sum(50 <= t < 100 for t in times)
    assert abs(first_half - 100) <= 2 and abs(second_half - 200) <= 2
    assert times == sorted(times)
