"""The autoscaling policies: no flapping under a noisy steady load; a scale-down parks workers
on standby before stopping them; on a ramp the forecast asks for capacity before the load
needs it; the warm pool is held; the reactive baseline scales as the HPA does."""

from __future__ import annotations

import dataclasses
import random
from itertools import pairwise

import pytest

from control.scale_policy import (
    POLICY_NAMES,
    PolicyParams,
    ScaleDecision,
    ScalePolicy,
    ScaleSignals,
    make_policy,
)

# A worker serves 1,000 tokens a second at a full batch; a request is 1,000 tokens and holds
# a place for 64 s, so a load of L workers is L requests a second and 64 L running.
CAPACITY = 1000.0
PARAMS = PolicyParams()


def _signals(
    now_s: float,
    load: float,
    *,
    waiting: int = 0,
    running: int | None = None,
    ready: int = 0,
    standby: int = 0,
    loading: int = 0,
):
    return ScaleSignals(
        now_s=now_s,
        arrival_rate_per_s=load,
        arrival_tokens_per_s=load * CAPACITY,
        num_waiting=waiting,
        num_running=round(64 * load) if running is None else running,
        worker_tokens_per_s=CAPACITY,
        num_ready=ready,
        num_standby=standby,
        num_loading=loading,
        num_draining=0,
    )


def _run(policy: ScalePolicy, load, until_s: float, tick_s: float = 5.0):
    """(time, decision) at every tick of `load(t)`."""
    return [
        (t, policy.decide(_signals(t, load(t))))
        for t in (k * tick_s for k in range(int(until_s / tick_s) + 1))
    ]


def _first_time(decisions: list[tuple[float, ScaleDecision]], num_ready: int) -> float:
    return next(t for t, d in decisions if d.num_ready >= num_ready)


def test_policies_are_made_by_name_each_with_its_own_state():
    for name in POLICY_NAMES:
        assert make_policy(name, PARAMS).name == name
    assert make_policy("predictive", PARAMS) is not make_policy("predictive", PARAMS)
    with pytest.raises(ValueError, match="unknown autoscale policy"):
        make_policy("psychic", PARAMS)


@pytest.mark.parametrize("name", ["predictive", "predictive+warm"])
def test_no_flapping_under_a_noisy_steady_load(name):
    # 4 workers of load, with 10% noise on the arrivals of every 5-s tick (what a 10-s window
    # of ~15 requests a second shows) and Poisson noise on the 256 running: after the first
    # minutes, at most a few changes an hour, never down within the delay of a change up.
    # (The reactive baseline, as the HPA, steps up whenever one poll crosses a boundary and
    # back 300 s later: 7 changes in this hour.)
    rng = random.Random(3)
    policy = make_policy(name, PARAMS)
    counts = []
    for k in range(840):  # 70 minutes
        load = 4 * (1 + rng.gauss(0, 0.1))
        signals = _signals(5.0 * k, load, running=round(rng.gauss(256, 16)))
        counts.append((5.0 * k, policy.decide(signals).num_ready))
    counts = [(t, n) for t, n in counts if t >= 600]
    changes = [(t, b - a) for (_, a), (t, b) in pairwise(counts) if a != b]
    assert len(changes) <= 4, changes
    for (t0, up), (t1, down) in pairwise(changes):
        if up > 0 > down:
            assert t1 - t0 >= PARAMS.scale_down_delay_s


def test_a_scale_down_parks_workers_on_standby_then_stops_them_after_the_quiet_period():
    # 6 workers of load (8 serving at 80%), then 1.5 from t = 600 s: 2 serving at 80%, 3
    # with the hysteresis' 20% more (2.25), which is where the scale-down stops.
    decisions = dict(
        _run(make_policy("predictive", PARAMS), lambda t: 6.0 if t < 600 else 1.5, 1500)
    )
    assert all(
        d == ScaleDecision(8, 0, d.forecast_tokens_per_s)
        for t, d in decisions.items()
        if t < 600 + PARAMS.scale_down_delay_s
    )
    parked = decisions[800]
    assert (parked.num_ready, parked.num_standby) == (3, 5)  # none stopped yet
    assert all(d.num_workers == 8 for t, d in decisions.items() if t < 800)
    after_quiet = decisions[800 + PARAMS.standby_quiet_s]
    assert (after_quiet.num_ready, after_quiet.num_standby) == (3, 0)
    # Parked as long as a new cold start would cost: the rent-or-buy break-even.
    assert PARAMS.standby_quiet_s == PARAMS.cold_start_s


def test_a_scale_up_takes_parked_workers_back_before_asking_for_new_ones():
    def load(t: float) -> float:
        return 6.0 if t < 600 or t >= 900 else 1.5  # down, parked by 800 s, back up at 900 s

    decisions = dict(_run(make_policy("predictive", PARAMS), load, 1000))
    assert (decisions[800].num_ready, decisions[800].num_standby) == (3, 5)
    back = decisions[1000]
    assert back.num_ready >= 8 and back.num_standby == 0
    assert back.num_workers == back.num_ready  # no worker beyond those already running


def test_on_a_ramp_predictive_asks_for_workers_before_reactive_does():
    # 2 to 10 workers of load over 5 minutes, nothing waiting: reactive follows the
    # requests in the system; predictive plans for the load a cold start ahead.
    def ramp(t: float) -> float:
        return 2 + 8 * min(max(t - 60, 0), 300) / 300

    predictive = _run(make_policy("predictive", PARAMS), ramp, 900)
    reactive = _run(make_policy("reactive", PARAMS), ramp, 900)
    # The forecast's rise is capped at 25% of its level (no overshoot on a step): it still
    # leads by 30-45 s here; a policy that waited for the queue would lead by none.
    for num_ready in (8, 10, 12):
        assert _first_time(reactive, num_ready) - _first_time(predictive, num_ready) >= 25
    # ... while the load itself is still below what those workers serve at 80%.
    t = _first_time(predictive, 10)
    assert ramp(t) < 0.8 * 9


def test_the_warm_pool_is_a_floor_over_the_baseline_not_refilled_in_a_surge():
    # 2 workers' worth (3 serving), 6 (8 serving) from 300 s to 900 s, 2 again after.
    params = PolicyParams(warm_pool=2)
    decisions = dict(
        _run(make_policy("predictive+warm", params), lambda t: 6.0 if 300 <= t < 900 else 2.0, 1800)
    )
    assert (decisions[295].num_ready, decisions[295].num_standby) == (3, 2)
    # In the surge the serving stand above the baseline (3) plus the pool: no worker is
    # started to stand by behind them (kept always, the pool would load 2 more); the only
    # standby is one the hysteresis let go, parked.
    surge = [d for t, d in decisions.items() if 320 <= t < 900]
    assert all(d.num_ready >= 8 for d in surge)
    assert max(d.num_workers for d in surge) == max(d.num_ready for d in surge)
    # After it, parked workers stand by for the quiet period, then the pool alone.
    assert (decisions[1795].num_ready, decisions[1795].num_standby) == (3, 2)
    assert all(
        d.num_standby == 0 for _, d in _run(make_policy("predictive", params), lambda t: 2.0, 300)
    )


def test_a_surge_longer_than_the_baseline_window_has_the_pool_refilled_over_it():
    params = PolicyParams(warm_pool=2, warm_pool_baseline_s=600.0)
    decisions = dict(
        _run(make_policy("predictive+warm", params), lambda t: 6.0 if t >= 300 else 2.0, 1200)
    )
    assert decisions[600].num_standby == 0
    assert decisions[1200].num_ready >= 8 and decisions[1200].num_standby == 2


def test_the_forecast_plans_for_no_more_than_its_growth_cap_over_a_step():
    # 2 to 10 workers' worth within 60 s, held. Extrapolated over a cold start (damped over
    # 600 s), the rise's trend planned for 1.83x the top (23 serving, where 13 serve it at
    # 80%); now for at most the level +25%, and Holt's level itself overshoots a step by 6%
    # (10.6): 1.32x, 17 serving.
    def step(t: float) -> float:
        return 2 + 8 * min(max(t - 300, 0), 60) / 60

    decisions = _run(make_policy("predictive", PARAMS), step, 1200)
    planned = max(d.forecast_tokens_per_s or 0.0 for _, d in decisions)
    assert 10 * CAPACITY <= planned <= 10.6 * CAPACITY * (1 + PARAMS.forecast_max_growth)
    assert max(d.num_ready for _, d in decisions) <= 17


def test_the_most_workers_bound_serving_and_standby_the_pool_giving_way_first():
    params = PolicyParams(warm_pool=3, min_workers=1, max_workers=10)
    policy = make_policy("predictive+warm", params)
    busy = policy.decide(_signals(0.0, 7.6))  # 10 serving wanted
    assert (busy.num_ready, busy.num_standby) == (10, 0)
    idle = make_policy("predictive+warm", params).decide(_signals(0.0, 0.0))
    assert (idle.num_ready, idle.num_standby) == (1, 3)


def test_a_backlog_asks_for_the_workers_that_drain_it_when_they_arrive():
    calm = make_policy("predictive", PARAMS).decide(_signals(0.0, 2.0, ready=3))
    assert calm.num_ready == 3
    # 600 waiting requests of 1,000 tokens: 600 worker-seconds. The 3 serving (2 workers'
    # worth arriving) drain 180 of them in the cold start a new worker takes; the 420 left
    # then, within 60 s, take 7 workers more than the arrivals' 2: 9 in all.
    backlog = make_policy("predictive", PARAMS).decide(_signals(0.0, 2.0, waiting=600, ready=3))
    assert backlog.num_ready == 9
    # Standby workers serve in seconds: with 4 of them, the 7 drain the 600 in 120 s, before
    # a new worker could serve: all are woken, none is started.
    woken = make_policy("predictive", PARAMS).decide(
        _signals(0.0, 2.0, waiting=600, ready=3, standby=4)
    )
    assert woken.num_ready == 7


def test_a_backlog_the_workers_on_their_way_drain_asks_for_no_more():
    # A spike: 9.5 workers' worth against 3 serving; the 10 ordered at t = 0 arrive at
    # 180 s. At 170 s, 100 worker-seconds wait: they grow for 10 s more, and the 13 then
    # drain them in under a minute, so no worker beyond the 12 the load wants is started
    # (counting the backlog on top of them wanted 12 + 100 / 60: 14).
    policy = make_policy("predictive", PARAMS)
    policy.decide(_signals(0.0, 9.5, ready=3, loading=10))
    for t in range(5, 170, 5):
        policy.decide(_signals(float(t), 9.5, ready=3, loading=10))
    late = policy.decide(_signals(170.0, 9.5, waiting=100, ready=3, loading=10))
    assert late.num_ready == 12  # ceil(9.5 / 0.8)
    # Had they been ordered just now, they would arrive too late: more are wanted.
    fresh = make_policy("predictive", PARAMS)
    fresh.decide(_signals(165.0, 9.5, ready=3, loading=10))
    assert fresh.decide(_signals(170.0, 9.5, waiting=100, ready=3, loading=10)).num_ready > 12


def test_with_no_minimum_a_policy_scales_to_zero_and_a_waiting_request_wakes_it():
    params = PolicyParams(min_workers=0, warm_pool=0)
    for name in POLICY_NAMES:
        assert make_policy(name, params).decide(_signals(0.0, 0.0)).num_ready == 0
        # Requests queued before any arrival was counted: nothing says what they cost yet.
        woken = make_policy(name, params).decide(_signals(0.0, 0.0, waiting=3, running=0))
        assert woken.num_ready == 1, name


def test_reactive_wants_one_worker_per_threshold_in_the_system_and_scales_as_the_hpa():
    policy = make_policy("reactive", PARAMS)
    assert policy.decide(_signals(0.0, 0, running=96)).num_ready == 2  # 96 / 48
    # Up: at most to max(2x, +4) per poll, and only every poll (15 s).
    assert policy.decide(_signals(5.0, 0, running=960)).num_ready == 2
    assert policy.decide(_signals(15.0, 0, running=960)).num_ready == 6
    assert policy.decide(_signals(30.0, 0, running=960)).num_ready == 12
    assert policy.decide(_signals(45.0, 0, running=960)).num_ready == 20
    # Down: not within the 300-s stabilization window, then one worker a minute.
    counts = {t: policy.decide(_signals(t, 0, running=96)).num_ready for t in range(60, 600, 15)}
    assert all(n == 20 for t, n in counts.items() if t <= 45 + 300)
    assert counts[360] == 19 and counts[405] == 19 and counts[420] == 18
    assert all(d.num_standby == 0 for _, d in _run(policy, lambda t: 1.0, 60))


def test_params_of_the_settings():
    from shared.settings import Settings

    # The settings' defaults are the policy's, but for the most workers: 4 for a local
    # fleet (`llmfleet up`), where the simulator's default allows 64.
    of_defaults = PolicyParams.of(Settings())
    assert dataclasses.replace(of_defaults, max_workers=PARAMS.max_workers) == PARAMS

    settings = Settings(autoscale_cold_start_s=90, autoscale_warm_pool=3, autoscale_max_workers=7)
    params = PolicyParams.of(settings)
    assert (params.cold_start_s, params.warm_pool, params.max_workers) == (90, 3, 7)
    assert params.scale_down_delay_s == settings.autoscale_scale_down_delay_s
    assert params.standby_quiet_s == settings.autoscale_standby_quiet_s
    assert params.min_workers == settings.autoscale_min_workers
