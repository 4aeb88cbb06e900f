"""Workload: the requests a benchmark sends, and when, decided before the run starts.

A workload is plain data (`RequestSpec`), generated from a seed, so two servers can be
measured against exactly the same arrivals, prompts and output lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ARRIVALS = ("poisson", "burst")


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant of a multi-tenant scenario."""

    name: str
    weight: int = 1
    tier: int = 1
    max_requests_in_flight: int | None = None  # engine-direct stands in for the API's limit


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload."""

    index: int
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: list[int]
    max_tokens: int  # the output length is forced: clients send ignore_eos=True
    tenant: str = "bench"  # multi-tenant scenarios (bench/scenarios.py)


def make_workload(
    num_requests: int,
    *,
    seed: int = 0,
    arrival: str = "poisson",
    rate_per_s: float = 16.0,
    burst_window_s: float = 2.0,
    prompt_tokens_min: int = 32,
    prompt_tokens_max: int = 512,
    output_tokens_mean: float = 128.0,
    output_tokens_max: int = 512,
    long_prompt_fraction: float = 0.0,
    long_prompt_tokens: int = 2048,
    shared_prefix_tokens: int = 0,
    vocab_min: int = 1000,
    vocab_max: int = 20000,
) -> list[RequestSpec]:
    """Generate `num_requests` requests, sorted by arrival, deterministic for a given seed.

    Arrivals: "poisson" draws exponential gaps at `rate_per_s`, the first request at 0 s;
    "burst" spreads all requests uniformly over [0, burst_window_s]. Prompt lengths are
    uniform in [prompt_tokens_min, prompt_tokens_max], except that with probability
    `long_prompt_fraction` a request gets exactly `long_prompt_tokens`. Output lengths are
    exponential with mean `output_tokens_mean`, rounded, clamped to [1, output_tokens_max].
    Prompt token ids are uniform in [vocab_min, vocab_max) (half-open, like `range`).
    With `shared_prefix_tokens`, every prompt starts with the same that many tokens (a
    system prompt) before its own; the rest of the workload is as without it.
    """
    _check_args(num_requests, arrival, prompt_tokens_min, prompt_tokens_max, vocab_min, vocab_max)
    if not 0.0 <= long_prompt_fraction <= 1.0:
        raise ValueError(f"long_prompt_fraction must be in [0, 1], got {long_prompt_fraction}")
    rng = np.random.default_rng(seed)
    if arrival == "poisson":
        arrivals_s = _poisson_arrivals_s(rng, num_requests, rate_per_s)
    else:
        arrivals_s = np.sort(rng.uniform(0.0, burst_window_s, size=num_requests))
    is_long = rng.random(num_requests) < long_prompt_fraction
    num_prompt_tokens = rng.integers(
        prompt_tokens_min, prompt_tokens_max, size=num_requests, endpoint=True
    )
    num_prompt_tokens = np.where(is_long, long_prompt_tokens, num_prompt_tokens)
    max_tokens = _output_lengths(rng, num_requests, output_tokens_mean, output_tokens_max)
    prompts = [
        rng.integers(vocab_min, vocab_max, size=int(num_prompt_tokens[i])).tolist()
        for i in range(num_requests)
    ]
    if shared_prefix_tokens > 0:  # drawn last: the other draws stay as without it
        prefix = rng.integers(vocab_min, vocab_max, size=shared_prefix_tokens).tolist()
        prompts = [prefix + prompt for prompt in prompts]
    return [
        RequestSpec(
            index=i,
            arrival_s=float(arrivals_s[i]),
            prompt_token_ids=prompts[i],
            max_tokens=int(max_tokens[i]),
        )
        for i in range(num_requests)
    ]


def _check_args(
    num_requests: int,
    arrival: str,
    prompt_tokens_min: int,
    prompt_tokens_max: int,
    vocab_min: int,
    vocab_max: int,
) -> None:
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if not 1 <= prompt_tokens_min <= prompt_tokens_max:
        raise ValueError("need 1 <= prompt_tokens_min <= prompt_tokens_max")
    if not 0 <= vocab_min < vocab_max:
        raise ValueError("need 0 <= vocab_min < vocab_max")


def _poisson_arrivals_s(
    rng: np.random.Generator, num_requests: int, rate_per_s: float
) -> np.ndarray:
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    gaps_s = rng.exponential(1.0 / rate_per_s, size=num_requests)
    # The first request goes out at 0 s so the run does not start with an idle gap.
    return np.concatenate(([0.0], np.cumsum(gaps_s[:-1])))[:num_requests]


def _output_lengths(
    rng: np.random.Generator, num_requests: int, mean_tokens: float, max_tokens: int
) -> np.ndarray:
    if mean_tokens <= 0 or max_tokens < 1:
        raise ValueError("need output_tokens_mean > 0 and output_tokens_max >= 1")
    lengths = np.rint(rng.exponential(mean_tokens, size=num_requests))
    return np.clip(lengths, 1, max_tokens).astype(np.int64)
