"""The step's token budget: large while nothing decodes or a backlog of prompt work waits,
small beside decodes otherwise, and beside decodes within the ITL target's guard (by
feedback from measured steps)."""

from __future__ import annotations

from tests.factories import make_sequence
from worker.fair_queue import FairQueue, FifoQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import LatestArrivalFirst, TenantAwarePreemption
from worker.scheduler import Scheduler, SchedulerConfig
from worker.token_budget import DRAIN_STEPS, MIN_TOKENS, TokenBudget


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
    for _ in range(20):  # a backlog asks for more, and full steps stay fast: the guard grows
        step_budget = budget.for_step(has_decodes=True, waiting_tokens=10_000)
        budget.observe(step_budget, step_budget, True, 0.01)
    assert budget.for_step(has_decodes=True, waiting_tokens=10_000) == 1024  # the ceiling
    assert budget.for_step(has_decodes=True) == 192  # no backlog: the small budget
    budget.observe(1024, 1024, has_decodes=True, seconds=100.0)
    assert budget.for_step(has_decodes=True, waiting_tokens=10_000) == MIN_TOKENS
    budget.observe(1000, 1000, has_decodes=False, seconds=100.0)  # no decode waited on it
    assert budget.for_step(has_decodes=True) == MIN_TOKENS


def test_without_a_target_the_budget_beside_decodes_is_fixed():
    budget = TokenBudget(192, 1024, None)
    budget.observe(192, 192, has_decodes=True, seconds=10.0)
    assert budget.for_step(has_decodes=True) == 192
    budget.observe(1024, 1024, has_decodes=True, seconds=10.0)
    assert budget.for_step(has_decodes=True, waiting_tokens=10_000) == 1024


def test_beside_decodes_a_backlog_of_prompt_work_takes_the_large_budget():
    budget = TokenBudget(384, 2048, None, shared_tokens=192)
    # up to DRAIN_STEPS small steps' worth is a prompt or two arriving: small steps
    assert budget.for_step(has_decodes=True, waiting_tokens=DRAIN_STEPS * 384) == 384
    assert budget.for_step(has_decodes=True, waiting_tokens=DRAIN_STEPS * 384 + 1) == 2048
    assert budget.for_step(has_decodes=True, is_shared=True, waiting_tokens=10_000) == 192
    assert TokenBudget(384, None, None).for_step(has_decodes=True, waiting_tokens=10_000) == 384


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
    """Large steps while the burst's backlog is more than DRAIN_STEPS small steps would
    clear (the first with nothing decoding yet), then small ones beside its decodes."""
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_num_prefill_tokens=512)
    scheduler = Scheduler(config, KVCacheManager(256, 16), FifoQueue(), LatestArrivalFirst())
    for i in range(16):
        scheduler.add(make_sequence(i, num_prompt_tokens=100, max_tokens=50))
    per_step = _schedule_all(scheduler)
    # 1,600 prompt tokens: 512 with nothing decoding, then 512 with the first five decodes,
    # and 512 again (583 left, more than 2 x 64); the last 69 in small steps beside decodes
    assert DRAIN_STEPS == 2
    assert per_step[:3] == [512] * 3 and max(per_step[3:]) <= 64 and len(per_step) == 5
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


def test_a_large_step_takes_long_prompts_in_chunks_as_large_in_proportion():
    """`max_prefill_attention` bounds a chunk's tokens x context for a step of
    `max_num_batched_tokens`; a step of a larger budget (a backlog's) scales it, so a long
    prompt is not cut into as many steps as it would be beside a small budget."""
    steps = {}
    for prefill_tokens in (None, 512):
        config = SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_num_prefill_tokens=prefill_tokens,
            max_prefill_attention=64 * 64,
        )
        scheduler = Scheduler(config, KVCacheManager(256, 16), FifoQueue(), LatestArrivalFirst())
        scheduler.add(make_sequence(0, num_prompt_tokens=400, max_tokens=5))
        steps[prefill_tokens] = _schedule_all(scheduler)
    assert steps[512][0] == 64 * 64 * 8 // 400  # 81: the cap x 512 / 64, over 400 of context
    assert len(steps[None]) > 2 * len(steps[512])
