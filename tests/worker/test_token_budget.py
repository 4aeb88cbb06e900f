"""The step's token budget: large while nothing decodes, and beside decodes the most that
keeps a step within the ITL target (by feedback from measured steps)."""

from __future__ import annotations

from tests.factories import make_sequence
from worker.fair_queue import FairQueue, FifoQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import LatestArrivalFirst, TenantAwarePreemption
from worker.scheduler import Scheduler, SchedulerConfig
from worker.token_budget import MIN_TOKENS, TokenBudget


def test_a_step_with_no_decodes_takes_the_prefill_budget():
    budget = TokenBudget(192, 1024, None)
    assert budget.for_step(has_decodes=False) == 1024
    assert budget.for_step(has_decodes=True) == 192
    assert TokenBudget(192, None, None).for_step(has_decodes=False) == 192


def test_beside_decodes_the_budget_follows_the_itl_target():
    budget = TokenBudget(192, 1024, itl_target_s=0.1)
    budget.observe(192, 192, has_decodes=True, seconds=0.2)  # twice the target
    assert budget.for_step(has_decodes=True) == 96
    budget.observe(50, 96, has_decodes=True, seconds=0.01)  # fast, but the budget was not used
    assert budget.for_step(has_decodes=True) == 96
    budget.observe(96, 96, has_decodes=True, seconds=0.05)  # full and well under: grows
    assert budget.for_step(has_decodes=True) == 120
    budget.observe(120, 120, has_decodes=True, seconds=0.09)  # full, near the target: stays
    assert budget.for_step(has_decodes=True) == 120
    for _ in range(20):
        budget.observe(budget.decode_tokens, budget.decode_tokens, True, 0.01)
    assert budget.for_step(has_decodes=True) == 1024  # never past the prefill budget
    budget.observe(1024, 1024, has_decodes=True, seconds=100.0)
    assert budget.for_step(has_decodes=True) == MIN_TOKENS
    budget.observe(1000, 1000, has_decodes=False, seconds=100.0)  # no decode waited on it
    assert budget.for_step(has_decodes=True) == MIN_TOKENS


def test_without_a_target_the_budget_beside_decodes_is_fixed():
    budget = TokenBudget(192, 1024, None)
    budget.observe(192, 192, has_decodes=True, seconds=10.0)
    assert budget.for_step(has_decodes=True) == 192


def _schedule_all(scheduler: Scheduler) -> list[int]:
    """Tokens per step until every prompt is computed (decodes sample a fixed token)."""
    per_step = []
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in scheduler.running) or (
        scheduler.num_waiting
    ):
        out = scheduler.schedule()
        per_step.append(out.num_batched_tokens)
        scheduler.postprocess(out, [65] * sum(chunk.is_sampling for chunk in out.chunks))
    return per_step


def test_a_burst_is_prefilled_in_few_large_steps_then_small_ones_beside_its_decodes():
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_num_prefill_tokens=512)
    scheduler = Scheduler(config, KVCacheManager(256, 16), FifoQueue(), LatestArrivalFirst())
    for i in range(16):
        scheduler.add(make_sequence(i, num_prompt_tokens=100, max_tokens=50))
    per_step = _schedule_all(scheduler)
    assert per_step[0] == 512  # nothing decodes yet: five prompts and part of a sixth
    assert max(per_step[1:]) <= 64  # then five decode beside every later step
    fixed = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64)
    scheduler = Scheduler(fixed, KVCacheManager(256, 16), FifoQueue(), LatestArrivalFirst())
    for i in range(16):
        scheduler.add(make_sequence(i, num_prompt_tokens=100, max_tokens=50))
    assert len(_schedule_all(scheduler)) > len(per_step)


def test_a_step_shared_by_several_tenants_takes_at_most_the_shared_budget():
    budget = TokenBudget(384, 1024, None, shared_tokens=192)
    assert budget.for_step(has_decodes=True) == 384
    assert budget.for_step(has_decodes=True, is_shared=True) == 192
    assert budget.for_step(has_decodes=False, is_shared=True) == 192
    assert TokenBudget(384, None, None).for_step(has_decodes=True, is_shared=True) == 384
    assert TokenBudget(128, None, None, 192).for_step(has_decodes=True, is_shared=True) == 128


def test_the_scheduler_caps_the_step_while_another_tenant_has_work_running_or_waiting():
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, shared_batched_tokens=64)
    scheduler = Scheduler(config, KVCacheManager(512, 16), FairQueue(), TenantAwarePreemption())
    for i in range(4):
        scheduler.add(make_sequence(i, tenant_id="a", num_prompt_tokens=200, max_tokens=50))
    alone = scheduler.schedule()
    assert alone.token_budget == 256 and alone.num_batched_tokens == 256
    scheduler.postprocess(alone, [65] * sum(chunk.is_sampling for chunk in alone.chunks))
    scheduler.add(make_sequence(9, tenant_id="b", num_prompt_tokens=20, max_tokens=5))
    shared = scheduler.schedule()  # b waits (or is admitted): two tenants have work
    assert shared.token_budget == 64 and shared.num_batched_tokens <= 64


def test_a_tenant_whose_requests_ended_keeps_the_step_capped_for_the_shared_window():
    """A light tenant's request often ends before its next one comes (burst-fill's B): for
    `shared_window_s` after it last had work the worker still counts it, so its next request
    does not wait for a step of a neighbour's larger prompt work; after that, the tenant
    left alone gets the full budget again."""
    config = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=256, shared_batched_tokens=64, shared_window_s=10.0
    )
    scheduler = Scheduler(config, KVCacheManager(512, 16), FairQueue(), TenantAwarePreemption())
    scheduler.add(make_sequence(9, tenant_id="b", num_prompt_tokens=20, max_tokens=1))
    b_only = scheduler.schedule(now_s=100.0)
    assert b_only.token_budget == 256
    outputs = scheduler.postprocess(b_only, [65])
    assert outputs[0].is_finished and not scheduler.has_work()  # b has nothing here now
    for i in range(4):
        scheduler.add(make_sequence(i, tenant_id="a", num_prompt_tokens=200, max_tokens=50))
    soon_after = scheduler.schedule(now_s=105.0)
    assert soon_after.token_budget == 64 and soon_after.num_batched_tokens == 64
    scheduler.postprocess(soon_after, [65] * sum(c.is_sampling for c in soon_after.chunks))
    after_the_window = scheduler.schedule(now_s=110.5)
    assert after_the_window.token_budget == 256 and after_the_window.num_batched_tokens == 256
