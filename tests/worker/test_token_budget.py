"""The step's token budget: large while nothing decodes or a backlog of prompt work waits,
small beside decodes otherwise, and beside decodes within the ITL target's guard (by
feedback from measured steps)."""

from __future__ import annotations

from tests.factories import make_sequence
from worker.fair_queue import FairQueue, FifoQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import LatestArrivalFirst, TenantAwarePreemption
from worker.scheduler import Scheduler, SchedulerConfig
from worker.token_budget import DRAIN_STEPS, MIN_PROMPT_TO_DECODES, MIN_TOKENS, TokenBudget


def test_a_step_with_no_decodes_takes_the_prefill_budget():
    budget = TokenBudget(192, 1024, None)
    assert budget.for_step(num_decodes=0) == 1024
    assert budget.for_step(num_decodes=1) == 192
    assert TokenBudget(192, None, None).for_step(num_decodes=0) == 192


def test_beside_decodes_the_prompt_work_follows_the_itl_target():
    budget = TokenBudget(192, 1024, itl_target_s=0.1)
    budget.observe(8, 8, num_decodes=8, seconds=0.02)  # 8 decodes alone: 20 ms
    # 184 prompt tokens took the other 240 ms; the target leaves 80 ms beside the decodes
    budget.observe(192, 192, num_decodes=8, seconds=0.26)
    assert budget.guard_tokens == 184 * 80 // 240 == 61
    assert budget.for_step(num_decodes=8) == 8 + 61
    budget.observe(50, 69, num_decodes=8, seconds=0.01)  # fast, but the budget was not used
    assert budget.for_step(num_decodes=8) == 69
    budget.observe(69, 69, num_decodes=8, seconds=0.05)  # full and well under: grows
    assert budget.for_step(num_decodes=8) == 8 + 76
    budget.observe(84, 84, num_decodes=8, seconds=0.09)  # full, near the target: stays
    assert budget.for_step(num_decodes=8) == 84
    for _ in range(20):  # a backlog asks for more, and full steps stay fast: the guard grows
        step_budget = budget.for_step(num_decodes=8, waiting_tokens=10_000)
        budget.observe(step_budget, step_budget, 8, 0.01)
    assert budget.for_step(num_decodes=8, waiting_tokens=10_000) == 1024  # the ceiling
    assert budget.for_step(num_decodes=8) == 192  # no backlog: the small budget
    budget.observe(1024, 1024, num_decodes=8, seconds=100.0)
    assert budget.for_step(num_decodes=8, waiting_tokens=10_000) == 8 + MIN_TOKENS
    budget.observe(1000, 1000, num_decodes=0, seconds=0.01)  # no decode waited on it
    assert budget.for_step(num_decodes=8) == 8 + MIN_TOKENS


def test_a_step_with_no_decodes_sizes_the_guard_for_the_steps_after_it():
    """A burst's first step has nothing decoding yet, so no ITL waits on it, but it says what
    prompt tokens cost: the next step, beside the first prompts' decodes, is cut to the
    target at once rather than after a step of the whole prefill budget."""
    budget = TokenBudget(384, 2048, itl_target_s=0.15)
    budget.observe(2048, 2048, num_decodes=0, seconds=0.6)
    assert budget.guard_tokens == 512
    assert budget.for_step(num_decodes=0) == 2048  # steps with no decodes stay large
    assert budget.for_step(num_decodes=10, waiting_tokens=10_000) == 10 + 512
    assert TokenBudget(384, 2048, 0.15).for_step(num_decodes=10, waiting_tokens=10_000) == 2048


def test_a_step_over_the_target_is_cut_by_its_prompt_part_not_by_its_decodes():
    """The decodes' share of a step does not shrink with its prompt work: a step cut in
    proportion to its whole time would keep 937 tokens, 873 of them prompt tokens, and run
    40 + 873 x 0.2 = 215 ms, over the target again."""
    budget = TokenBudget(384, 2048, itl_target_s=0.2)
    budget.observe(64, 64, num_decodes=64, seconds=0.04)  # 64 decodes alone: 40 ms
    budget.observe(2048, 2048, num_decodes=64, seconds=0.4368)  # 1,984 prompt tokens: 0.2 ms
    assert budget.guard_tokens == 800  # 160 ms of the target left
    assert budget.for_step(num_decodes=64, waiting_tokens=10_000) == 64 + 800


def test_the_prompts_keep_three_quarters_of_a_step_beside_costly_decodes():
    """Where the decodes are a large part of every step (long-context decodes), the target
    yields: a backlog's step keeps at least 3x the decodes' time for its prompt tokens, or
    the backlog would take ever more steps, each paying for every decode again."""
    assert MIN_PROMPT_TO_DECODES == 3
    budget = TokenBudget(384, 2048, itl_target_s=0.2)
    budget.observe(64, 64, num_decodes=64, seconds=0.1)  # 64 decodes alone: 100 ms
    budget.observe(2048, 2048, num_decodes=64, seconds=0.5)  # 1,984 prompt tokens: 400 ms
    assert budget.guard_tokens == 1488  # 300 ms of prompt tokens, not the 496 within 200 ms
    # decodes that alone take the target: no prompt budget meets it
    alone = TokenBudget(384, 2048, itl_target_s=0.2)
    alone.observe(32, 32, num_decodes=32, seconds=0.25)
    alone.observe(2048, 2048, num_decodes=32, seconds=0.9)
    assert alone.guard_tokens == 2048
    assert alone.for_step(num_decodes=32) == 384  # little prompt work: the steady budget


def test_the_prompts_share_grows_with_the_decodes_of_a_backlog():
    """A burst's backlog on a slow CPU (session 41, AMD Zen 1: a prompt token ~3.7 ms): its
    first tokens join the decodes of every step, so the decodes' part grows while the
    backlog drains. A guard cut beside one decode must not stay that small: beside 17
    decodes the prompts still keep three times the decodes' part (before: it stayed at 35
    tokens, a third of the step, and the backlog's last first token came ~28% later)."""
    budget = TokenBudget(384, 2048, itl_target_s=0.15)
    budget.observe(300, 2048, num_decodes=0, seconds=1.1)  # 3.67 ms a prompt token
    budget.observe(41, 41, num_decodes=1, seconds=0.19)  # 40 of them: 43 ms left to the decode
    assert budget.guard_tokens == 35  # three times 43 ms of prompt tokens
    budget.observe(52, 52, num_decodes=17, seconds=0.25)  # 35 of them: 122 ms of decodes
    assert budget.guard_tokens == 99  # 3 x 122 ms at 3.67 ms a token, not 35
    assert budget.for_step(num_decodes=17, waiting_tokens=10_000) == 17 + 99


def test_through_the_scheduler_a_backlog_keeps_three_quarters_of_its_steps():
    """A burst of 32 prompts on a step-time model of a slow CPU (30 ms a step, 3.7 ms a
    prompt token, 5.2 ms a decode; session 41's AMD Zen 1 host): decodes that alone take the
    150 ms target once 23 stream. Every backlog step beside 8 or more decodes keeps at least
    nine tenths of three times the decodes' part for its prompts (a step after a prompt
    completes has one more decode than the guard was sized for)."""
    config = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=384, max_num_prefill_tokens=2048,
        itl_target_s=0.15,
    )  # fmt: skip
    scheduler = Scheduler(config, KVCacheManager(4096, 16), FifoQueue(), LatestArrivalFirst())
    for i in range(32):
        scheduler.add(make_sequence(i, num_prompt_tokens=300, max_tokens=1000))
    shares = []
    while scheduler._num_prompt_tokens_to_compute():
        num_decodes, num_prompt, _ = _timed_step(
            scheduler, lambda decodes, prompt: 0.03 + 0.0052 * decodes + 0.0037 * prompt
        )
        if num_decodes >= 8 and scheduler._num_prompt_tokens_to_compute():
            # the prompts' time over the decodes' (the guard is whole tokens: one more)
            shares.append(0.0037 * (num_prompt + 1) / (0.03 + 0.0052 * num_decodes))
    assert len(shares) > 10 and min(shares) > 0.9 * MIN_PROMPT_TO_DECODES


def test_without_a_step_of_decodes_alone_their_part_is_what_the_prompt_tokens_leave():
    """During a burst's backlog every step beside decodes carries prompt work: their part is
    what the prompt tokens' cost, from the burst's first step (no decodes), leaves."""
    budget = TokenBudget(384, 2048, itl_target_s=0.2)
    budget.observe(2048, 2048, num_decodes=0, seconds=0.4096)  # 0.2 ms a prompt token
    assert budget.guard_tokens == 1000
    budget.observe(1032, 1032, num_decodes=32, seconds=0.24)  # 200 ms of prompt, 40 of decodes
    assert budget.guard_tokens == 800  # 160 ms of prompt tokens fit beside 40 ms of decodes
    budget.observe(32, 32, num_decodes=32, seconds=0.02)  # decodes alone, measured: 20 ms
    budget.observe(832, 832, num_decodes=32, seconds=0.23)  # 210 ms of prompt
    assert budget.guard_tokens == 685  # 180 ms of 800 tokens at 210/800 ms


def _timed_step(scheduler: Scheduler, seconds_of) -> tuple[int, int, float]:
    """One step through the scheduler, timed by a model, `seconds_of(decodes, prompt
    tokens)`, and observed by its budget (decodes sample a fixed token): the step's decodes,
    prompt tokens and seconds."""
    out = scheduler.schedule()
    num_decodes = len(out.decodes)
    num_prompt = out.num_batched_tokens - num_decodes
    seconds = seconds_of(num_decodes, num_prompt)
    scheduler.budget.observe(out.num_batched_tokens, out.token_budget, num_decodes, seconds)
    scheduler.postprocess(out, [65] * sum(chunk.is_sampling for chunk in out.chunks))
    return num_decodes, num_prompt, seconds


def test_a_backlog_beside_decodes_settles_within_the_itl_target():
    """Through the scheduler, with steps timed by a model (1 ms a decode, 0.25 ms a prompt
    token, 3 ms fixed): a burst's prompts arrive while 24 sequences decode. Without a target
    its steps are of 2,048 tokens (~530 ms each, every decode waiting on it); with a 150 ms
    target every step after the first one over it is within the target (and a tenth: the
    guard grows by a quarter after a step under 80% of it, while more sequences join the
    decodes), and the prompts take a few more steps."""

    def run(itl_target_s: float | None) -> list[tuple[int, float]]:
        config = SchedulerConfig(
            max_num_seqs=64,
            max_num_batched_tokens=384,
            max_num_prefill_tokens=2048,
            itl_target_s=itl_target_s,
        )
        scheduler = Scheduler(config, KVCacheManager(2048, 16), FifoQueue(), LatestArrivalFirst())
        for i in range(24):
            scheduler.add(make_sequence(i, num_prompt_tokens=20, max_tokens=1000))
        steps = []
        while True:
            num_decodes, _, seconds = _timed_step(
                scheduler, lambda decodes, prompt: 0.003 + 0.001 * decodes + 0.00025 * prompt
            )
            if len(steps) == 2:  # the 24 decode: the burst of 32 prompts comes
                for i in range(100, 132):
                    scheduler.add(make_sequence(i, num_prompt_tokens=250, max_tokens=1000))
            steps.append((num_decodes, seconds))
            if len(steps) > 2 and not scheduler._num_prompt_tokens_to_compute():
                return steps[3:]

    fixed, guarded = run(None), run(0.15)
    assert max(seconds for _, seconds in fixed) > 0.5
    assert max(seconds for _, seconds in guarded[1:]) <= 0.15 * 1.1
    assert sum(s for _, s in guarded) < 1.5 * sum(s for _, s in fixed)


def test_beside_decodes_a_backlog_of_prompt_work_takes_the_large_budget():
    budget = TokenBudget(384, 2048, None, shared_tokens=192)
    # up to DRAIN_STEPS small steps' worth is a prompt or two arriving: small steps
    assert budget.for_step(num_decodes=1, waiting_tokens=DRAIN_STEPS * 384) == 384
    assert budget.for_step(num_decodes=1, waiting_tokens=DRAIN_STEPS * 384 + 1) == 2048
    assert budget.for_step(num_decodes=1, is_shared=True, waiting_tokens=10_000) == 192
    assert TokenBudget(384, None, None).for_step(num_decodes=1, waiting_tokens=10_000) == 384


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
    assert budget.for_step(num_decodes=1) == 384
    assert budget.for_step(num_decodes=1, is_shared=True) == 192
    assert budget.for_step(num_decodes=0, is_shared=True) == 192
    assert TokenBudget(384, None, None).for_step(num_decodes=1, is_shared=True) == 384
    assert TokenBudget(128, None, None, 192).for_step(num_decodes=1, is_shared=True) == 128


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


def test_a_guarded_backlog_step_takes_long_prompts_in_chunks_as_large_as_the_prefill_budgets():
    """A backlog's step that the ITL target's guard made smaller keeps the chunk cap of the
    prefill budget: the guard bounds the step by its measured time, and a cap scaled down
    with it would share the step among several long prompts in small chunks, every one of
    their first tokens later (a backlog of 1,000-1,800-token prompts, docs/benchmarks.md)."""
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_num_prefill_tokens=512,
        max_prefill_attention=64 * 64,
        itl_target_s=0.1,
    )
    scheduler = Scheduler(config, KVCacheManager(256, 16), FifoQueue(), LatestArrivalFirst())
    scheduler.add(make_sequence(0, num_prompt_tokens=10, max_tokens=50))
    first = scheduler.schedule()
    scheduler.postprocess(first, [65])  # sequence 0 decodes from now on
    for i in (1, 2):
        scheduler.add(make_sequence(i, num_prompt_tokens=400, max_tokens=5))
    scheduler.budget.guard_tokens = 150  # as a step over the target would have cut it
    out = scheduler.schedule()
    assert out.token_budget == 1 + 150 and len(out.decodes) == 1
    # one prompt takes the step's 150 tokens (the cap at 512: 64 x 64 x 8 / 150 = 218),
    # where a cap scaled to the step (151 / 64) would stop it at 64 and start the other
    assert [chunk.num_new_tokens for chunk in out.prefills] == [150]
