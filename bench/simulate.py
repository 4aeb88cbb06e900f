"""The scheduler on a simulated clock: the real `Scheduler`, KV-cache manager, fair queue and
preemption policy, with a model runner that computes nothing and instead advances a virtual
clock by what a step of that shape costs under a step-cost model.

It separates what the policy does from what the hardware does. On this project's 2-core CPU
a step's time grows with every token in it, so a tenant's prompt that shares a step with a
flood's work waits longer whatever the order of work; on a GPU a step of a model this size
costs about the same at 10 tokens as at 200. The same scenario under each cost model shows
which of the two a latency figure comes from. Runs take seconds and are deterministic.

The cost models are models, stated here, not measurements of a device:

- `cpu`: calibrated on this machine's bf16 steps (docs/benchmarks.md): 20 ms per step, plus
  0.4 ms per token computed, plus 5 us per token of context a decode attends to.
- `flat`: a step costs 10 ms plus 10 us per token computed (a device whose step time is
  flat in the batch at this model size, as a GPU's is).
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.config import EngineConfig
from worker.engine import ContinuousBatchingEngine, HandOff, build_scheduler
from worker.step_batch import SamplingFailure, StepBatch

NUM_KV_BLOCKS = 8192  # 131k tokens of 16, unless a run sets its pool (burst-kv)


@dataclass(frozen=True, slots=True)
class StepCost:
    fixed_s: float
    per_token_s: float
    per_context_token_s: float = 0.0

    def of(self, batch: StepBatch) -> float:
        context = sum(chunk.end for chunk in batch.decodes)
        return (
            self.fixed_s + self.per_token_s * batch.num_tokens + self.per_context_token_s * context
        )


COST_MODELS = {
    "cpu": StepCost(fixed_s=0.020, per_token_s=0.0004, per_context_token_s=0.000005),
    "flat": StepCost(fixed_s=0.010, per_token_s=0.00001),
}


@dataclass
class VirtualClock:
    """`now()` and `sleep()` for `bench.engine_direct.run_engine` and a scenario worker
    (`bench/scenario_driver.py`); steps advance it."""

    now_s: float = 1000.0  # not 0: a result's time of 0 would read as "not yet"

    def now(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += max(0.0, seconds)


@dataclass
class CostRunner:
    """A model runner that samples token 0 for every sequence and costs virtual time."""

    clock: VirtualClock
    cost: StepCost
    vocab_size: int = 2**31  # the workloads' token ids are all in the vocabulary

    def execute(self, batch: StepBatch) -> list[int | SamplingFailure]:
        self.clock.sleep(self.cost.of(batch))
        return [0 for chunk in batch.chunks if chunk.is_sampling]

    def release(self, request_id: str) -> None:
        pass


def build_engine(
    config: EngineConfig, clock: VirtualClock, cost: StepCost, hand_off: HandOff | None = None
) -> ContinuousBatchingEngine:
    """A continuous-batching engine as `worker.engine.build_engine` makes it, on `cost`
    (with `hand_off`: a prefill worker's, bench/disagg_sim.py)."""
    scheduler = build_scheduler(config, config.num_kv_blocks or NUM_KV_BLOCKS)
    return ContinuousBatchingEngine(scheduler, CostRunner(clock, cost), hand_off)


def engine_factory(cost: StepCost):
    """For `bench.scenario_driver.run_plan`: a fresh engine and clock per worker."""

    def make(config: EngineConfig) -> tuple[ContinuousBatchingEngine, VirtualClock]:
        clock = VirtualClock()
        return build_engine(config, clock, cost), clock

    return make


class NullDecoder:
    """Every token decodes to one character: the detokenizer has text to emit."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(token_ids)
