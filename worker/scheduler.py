"""The continuous-batching scheduler: which tokens of which sequences run in the next step.

Plain Python, no torch, no I/O. The step's output is a `SchedulerOutput`; the model runner
computes its `batch()` (`worker/step_batch.py`) in one forward pass and returns one sampled
token per sampling chunk.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shared.protocol import ErrorCode
from worker.fair_queue import QueuePolicy, SortKey
from worker.kv_cache import KVCacheManager
from worker.preemption import PreemptionPolicy
from worker.sequence import Sequence, SequenceOutput, SequenceStatus
from worker.step_batch import ChunkInput, StepBatch
from worker.token_budget import TokenBudget


@dataclass(slots=True)
class ScheduledChunk:
    """Feed tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of `seq`."""

    seq: Sequence
    num_new_tokens: int
    start: int  # seq.num_computed_tokens when scheduled

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_sampling(self) -> bool:
        """The chunk reaches the sequence's last token, so its last position yields a new token."""
        return self.end == self.seq.num_tokens

    def input(self) -> ChunkInput:
        seq = self.seq
        sampling = seq.sampling if self.is_sampling else None
        token_ids = seq.token_ids(self.start, self.end)
        return ChunkInput(seq.request_id, token_ids, self.start, list(seq.block_table), sampling)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work, over the live sequences; `batch()` is what the runner computes."""

    decodes: list[ScheduledChunk] = field(default_factory=list)  # one token each
    prefills: list[ScheduledChunk] = field(default_factory=list)  # prompt chunks, or recompute
    preempted: list[Sequence] = field(default_factory=list)
    token_budget: int = 0  # the step's budget (`TokenBudget.for_step`)
    # The tenants with work running when the step began, and whether the step admitted a
    # newcomer (another tenant's sequence): then it takes no more prompt work of theirs
    # (`Scheduler._is_held_back`).
    running_tenants: frozenset[str] = frozenset()
    has_newcomer: bool = False

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """In the order the runner packs them: decodes first, then prefills."""
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    def batch(self) -> StepBatch:
        """The step as plain data for the runner. Decodes are ordered by context first (their
        order carries no meaning; `postprocess` reads the same lists), so that decodes of
        similar length sit together and can share an attention call."""
        self.decodes.sort(key=lambda chunk: chunk.end)
        return StepBatch([c.input() for c in self.decodes], [c.input() for c in self.prefills])


MIN_PREFILL_CHUNK = 16


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Given by the engine's settings (`worker/config.py`, where the defaults live).
    max_num_seqs: int
    max_num_batched_tokens: int  # token budget of a step beside decodes: bounds decode ITL
    # The budget of a step in which no sequence decodes (None: the same), and the ITL
    # target that adapts the budget beside decodes (None: fixed). `worker/token_budget.py`.
    max_num_prefill_tokens: int | None = None
    itl_target_s: float | None = None
    # The budget's cap while more than one tenant has work here, or had within the last
    # `shared_window_s` seconds (None: no cap). A light tenant's requests often end before
    # its next one comes; without the memory its next request would wait for a step of a
    # neighbour's larger prompt work (the burst-fill scenario, docs/benchmarks.md).
    shared_batched_tokens: int | None = None
    shared_window_s: float = 10.0
    # A prefill chunk's attention costs (chunk tokens x context): late chunks of a long prompt
    # are cut so that product stays under this (256 x 512), or one 256-token chunk at 2,048
    # tokens of context makes its step 4x a decode step (docs/benchmarks.md).
    max_prefill_attention: int = 256 * 512
    max_step_failures: int = 2  # a sequence that fails alone this often is dead-lettered
    # Places beyond max_num_seqs that a request which may displace running work takes while
    # the KV cache has room, instead of preempting (recompute costs the victim; the places
    # only bound the step's size). None: an eighth of max_num_seqs, at least one.
    num_displacement_places: int | None = None

    @property
    def max_num_displacing_seqs(self) -> int:
        """The most sequences in the batch, displacers in the extra places included."""
        extra = self.num_displacement_places
        return self.max_num_seqs + (max(1, self.max_num_seqs // 8) if extra is None else extra)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        waiting: QueuePolicy,
        policy: PreemptionPolicy,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting = waiting
        self.policy = policy
        self.budget = TokenBudget(
            config.max_num_batched_tokens,
            config.max_num_prefill_tokens,
            config.itl_target_s,
            config.shared_batched_tokens,
        )
        self.running: list[Sequence] = []
        self.num_preemptions_by_tenant: Counter[str] = Counter()
        # Sequences of a failed step, each to be run alone until the one at fault is found.
        self.suspects: deque[Sequence] = deque()
        # (when to look at a sequence's deadlines, a tie-break, the sequence): `expire` looks
        # only at those whose time came, not at every sequence on every step. Finished ones
        # are dropped as they come up, or all at once when they are most of the heap.
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._tie_breaks = itertools.count()
        # When each tenant last had work here (for the shared budget), and the tenants of
        # the sequences added since the last step.
        self._tenants_seen_s: dict[str, float] = {}
        self._tenants_added: set[str] = set()

    def add(self, seq: Sequence) -> SequenceOutput | None:
        """Queue a sequence; refuse it at once (an error output) if it could never fit."""
        if not self.kv_cache.can_fit_alone(seq.num_max_tokens):
            return seq.refuse(
                ErrorCode.KV_CACHE_CAPACITY,
                f"the request needs up to {seq.num_max_tokens} tokens of KV cache; this worker "
                f"holds at most {self.kv_cache.max_num_tokens_per_sequence} per sequence",
            )
        self.waiting.push(seq)
        self._arrived(seq)
        return None

    def adopt(self, seq: Sequence) -> bool:
        """Take a sequence whose prompt another worker computed (a prefill/decode hand-off,
        issue 22) straight into the batch: blocks for every token but its last, which the
        caller fills with the KV it was sent (`seq.block_table`), its next step a decode of
        its last token. False, leaving it as it was, while the batch or the KV cache has no
        room for it: a decode worker takes hand-offs by its free capacity, never more than
        it can hold. Its prompt was charged to its tenant where it was computed; its decodes
        are charged here."""
        if seq.block_table or seq.status is not SequenceStatus.WAITING or not seq.output_token_ids:
            raise RuntimeError("adopt of a sequence that is not a hand-off")
        num_computed = seq.num_tokens - 1
        if len(self.running) >= self.config.max_num_seqs or not self.kv_cache.can_allocate(
            seq, num_computed
        ):
            return False
        self.kv_cache.allocate(seq, num_computed)
        seq.num_computed_tokens = seq.num_charged_tokens = num_computed
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._arrived(seq)
        return True

    def hand_off(self, seq: Sequence) -> None:
        """Let a running sequence go to another worker (a prefill worker's hand-off, issue 22)
        once the caller has copied its KV out: its blocks are freed, and nothing here ends,
        expires or outputs it again (it counts as finished here; its next tokens are the
        other worker's)."""
        if seq not in self.running:
            raise RuntimeError("hand_off of a sequence that is not running")
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def _arrived(self, seq: Sequence) -> None:
        """A sequence new here: its tenant counts as present, its deadlines are watched."""
        self._tenants_added.add(seq.tenant_id)
        deadlines = [d for d in (seq.queue_deadline_s, seq.deadline_s) if d is not None]
        if deadlines:
            self._watch(seq, min(deadlines))

    def _watch(self, seq: Sequence, at_s: float) -> None:
        if len(self._deadlines) > 2 * (self.num_running + self.num_waiting) + 64:
            self._deadlines = [item for item in self._deadlines if not item[2].is_finished]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (at_s, next(self._tie_breaks), seq))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def starting_soon(self, tenant_ids: Iterable[str]) -> set[str]:
        """Which of these tenants' new requests would start at once (displacing running
        work) or at the next free place: the intake then takes them even when the batch is
        full (`FairQueue.starting_soon`)."""
        return self.waiting.starting_soon(tenant_ids, self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preemptions(self) -> int:
        return sum(self.num_preemptions_by_tenant.values())

    def schedule(self, now_s: float | None = None) -> SchedulerOutput:
        """The running sequences' next tokens (one for a decode, the next chunk of a prompt
        or of its recompute) and the admission of waiting sequences, in the waiting queue's
        priority order while the step's token budget lasts. With fair queuing that is the
        tenant with the least computed service per unit of weight first, and within a
        tenant decodes first, so a light tenant's prompt does not wait behind a heavy
        tenant's work; with FIFO, all decodes first, then prefill work oldest first. When a
        running sequence needs a KV block and none is free, the policy picks a victim among
        the running sequences not yet scheduled this step (possibly the sequence itself);
        the victim's blocks are freed and it goes back to the front of its tenant's queue, to
        be recomputed. A waiting sequence is admitted only if nothing was preempted this
        step, `max_num_seqs` allows and all its tokens so far fit in the free blocks; the
        first that does not fit stops admission (no overtaking, so a long prompt cannot
        starve). Before all that, a full batch makes room for the waiting sequence that may
        displace running work (a higher tier, or a tenant a quantum below a running one's
        service: `_displace`), in an extra place while the KV cache has room, else by
        preempting; it is then admitted first. Every token computed is charged to the
        sequence's tenant: all of a sequence's tokens when it is admitted (its prompt, or everything again after a
        preemption), then each decode. `now_s` (a monotonic clock, read here when not given)
        dates the tenants seen, for the shared budget.
        """
        while self.suspects and self.suspects[0].is_finished:
            self.suspects.popleft()
        if self.suspects:
            return self._schedule_alone(self.suspects[0])
        num_decodes = sum(seq.num_tokens - seq.num_computed_tokens == 1 for seq in self.running)
        running_tenants = frozenset(seq.tenant_id for seq in self.running)
        out = SchedulerOutput(
            token_budget=self.budget.for_step(
                num_decodes,
                self._is_shared(running_tenants, time.monotonic() if now_s is None else now_s),
                self._num_prompt_tokens_to_compute(),
            ),
            running_tenants=running_tenants,
        )
        budget = out.token_budget
        scheduled: set[int] = set()
        if (displacer := self._displace(out)) is not None:
            self.waiting.remove(displacer)
            self._admit(displacer, budget, scheduled, out)
            budget = out.token_budget - out.num_batched_tokens
        can_admit = True
        priority = self.waiting.step_priority(self.running)
        for seq in sorted(self.running, key=priority):
            while can_admit and budget > 0 and self._is_waiting_ahead_of(seq, priority):
                can_admit = self._admit_next(budget, scheduled, out)
                budget = out.token_budget - out.num_batched_tokens
            budget = self._schedule_running(seq, budget, scheduled, out)
        while can_admit and budget > 0:
            can_admit = self._admit_next(budget, scheduled, out)
            budget = out.token_budget - out.num_batched_tokens
        self._check_invariants(out)
        return out

    def _schedule_alone(self, seq: Sequence) -> SchedulerOutput:
        """A step with `seq` only: after a failed step, to find the sequence at fault."""
        out = SchedulerOutput()
        if seq.status is SequenceStatus.WAITING:
            if self.kv_cache.num_blocks_for(seq.num_tokens) > self.kv_cache.num_free_blocks:
                victims = [s for s in self.running if s is not seq]
                while victims and not self.kv_cache.can_allocate(seq, seq.num_tokens):
                    victim = self.policy.pick_victim(victims, self.running)
                    victims.remove(victim)
                    self._preempt(victim, out)
            self.waiting.remove(seq)
            self._charge(seq, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        self._schedule_running(seq, self.config.max_num_batched_tokens, set(), out)
        self._check_invariants(out)
        return out

    def step_failed(self, out: SchedulerOutput, reason: str) -> list[SequenceOutput]:
        """The model step for `out` raised. Alone in it, the sequence is at fault: after
        `max_step_failures` it is dead-lettered (an error output); else it is retried. With
        others, every sequence of the step is recomputed, each alone first, so that one
        request that breaks the model cannot take the rest of the batch down with it."""
        seqs = [chunk.seq for chunk in out.chunks if not chunk.seq.is_finished]
        if len(seqs) == 1:
            seqs[0].num_failures += 1
            if seqs[0].num_failures >= self.config.max_step_failures:
                output = seqs[0].refuse(
                    ErrorCode.MODEL_ERROR,
                    f"the model failed {seqs[0].num_failures} times on this request: {reason}",
                )
                self._release(seqs[0])
                return [output]
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                self._requeue(seq)
            if seq not in self.suspects:
                self.suspects.append(seq)
        return []

    def _num_prompt_tokens_to_compute(self) -> int:
        """Prompt (or recompute) tokens not yet computed, of the batch and its queue."""
        left = (seq.num_tokens - seq.num_computed_tokens for seq in (*self.running, *self.waiting))
        return sum(n for n in left if n > 1)  # one left is a decode's

    def _is_shared(self, running_tenants: frozenset[str], now_s: float) -> bool:
        """Whether more than one tenant has work here (running or waiting), or had within
        the last `shared_window_s` seconds."""
        for tenant_id in running_tenants | self._tenants_added:
            self._tenants_seen_s[tenant_id] = now_s
        self._tenants_added.clear()
        since_s = now_s - self.config.shared_window_s
        if any(seen_s < since_s for seen_s in self._tenants_seen_s.values()):
            self._tenants_seen_s = {t: s for t, s in self._tenants_seen_s.items() if s >= since_s}
        if len(self._tenants_seen_s) > 1:
            return True
        tenants = set(running_tenants)
        for seq in self.waiting:
            if len(tenants) > 1:
                break
            tenants.add(seq.tenant_id)
        return len(tenants) > 1

    def _is_held_back(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """A step that admits a newcomer's prompt takes no prompt work of the tenants
        already running (their decodes still run): the newcomer's first token then waits
        for the step in flight and one short step, not for a step filled with a burst's
        prompt chunks, which on a CPU costs time in proportion to its tokens
        (test_tenant_scheduler: a newcomer's prompt step carries no other tenant's prompt
        work; the burst-fill scenario)."""
        return (
            out.has_newcomer
            and seq.tenant_id in out.running_tenants
            and seq.num_tokens - seq.num_computed_tokens > 1
        )

    def _schedule_running(
        self, seq: Sequence, budget: int, scheduled: set[int], out: SchedulerOutput
    ) -> int:
        """Schedule `seq`'s next tokens within `budget`; the budget left."""
        if budget == 0 or seq.status is not SequenceStatus.RUNNING or id(seq) in scheduled:
            return budget  # out of budget, preempted earlier in this step, or admitted in it
        if self._is_held_back(seq, out):
            return budget
        num_new = self._chunk_size(seq, budget, out.token_budget)
        if not self._make_room(seq, num_new, scheduled, out):
            return budget
        self._schedule_chunk(seq, num_new, out)
        scheduled.add(id(seq))
        return budget - num_new

    def _chunk_size(self, seq: Sequence, budget: int, step_budget: int) -> int:
        """How many of `seq`'s tokens to compute next: what is left, within the budget, and
        for a prompt chunk deep into a long prompt, within `max_prefill_attention`, which a
        step larger than `max_num_batched_tokens` (a backlog's) scales as for the prefill
        budget, whatever its own: the ITL target's guard bounds such a step by its measured
        time, and a cap scaled down with the guard would spread the step over many long
        prompts' small chunks, every one of their first tokens later (docs/benchmarks.md,
        session 32)."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if num_new <= MIN_PREFILL_CHUNK:
            return num_new
        context = seq.num_computed_tokens + num_new
        batched = self.config.max_num_batched_tokens
        scale = self.budget.prefill_tokens / batched if step_budget > batched else 1.0
        return max(
            MIN_PREFILL_CHUNK,
            min(num_new, int(self.config.max_prefill_attention * scale) // context),
        )

    def _is_waiting_ahead_of(self, seq: Sequence, priority: Callable[[Sequence], SortKey]) -> bool:
        head = self.waiting.peek()
        return head is not None and priority(head) < priority(seq)

    def _make_room(
        self, seq: Sequence, num_new: int, scheduled: set[int], out: SchedulerOutput
    ) -> bool:
        """Preempt until `seq` can take its blocks; False if `seq` itself was the victim."""
        while not self.kv_cache.can_allocate(seq, num_new):
            candidates = [s for s in self.running if id(s) not in scheduled]
            victim = self.policy.pick_victim(candidates, self.running)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _admit_next(self, budget: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Admit the waiting queue's next sequence with up to `budget` of its tokens; False
        when none can be admitted in this step."""
        seq = self.waiting.peek()
        if seq is None or out.preempted or not self._has_room_for(seq):
            return False
        if self._is_held_back(seq, out):
            return False
        self.waiting.pop()
        self._admit(seq, budget, scheduled, out)
        return True

    def _admit(self, seq: Sequence, budget: int, scheduled: set[int], out: SchedulerOutput) -> None:
        # Its cached prefix is computed already and costs nothing: only the rest is charged.
        seq.num_computed_tokens = seq.num_charged_tokens = self.kv_cache.admit(seq)
        self._charge(seq, seq.num_tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._schedule_chunk(seq, self._chunk_size(seq, budget, out.token_budget), out)
        scheduled.add(id(seq))
        if self.waiting.shortens_newcomer_steps and seq.tenant_id not in out.running_tenants:
            out.has_newcomer = True

    def _has_room_for(self, seq: Sequence) -> bool:
        return len(self.running) < self.config.max_num_seqs and self.kv_cache.can_admit(seq)

    def _displace(self, out: SchedulerOutput) -> Sequence | None:
        """When the batch is full (no slot, or too few free KV blocks), make room for the
        waiting queue's neediest sequence if it may displace running work
        (`FairQueue.may_displace`: a higher tier, or a tenant a quantum beyond its service):
        it takes one of the extra places over `max_num_seqs` while the KV cache has room
        (`num_displacement_places`), else running sequences it may displace are preempted,
        the policy's victim each time; that sequence, or None. All or nothing: no victim is
        preempted unless they free enough. FIFO never displaces."""
        seq = self.waiting.neediest()
        if seq is None or self._has_room_for(seq):
            return None
        if not any(self.waiting.may_displace(seq, victim) for victim in self.running):
            return None
        num_slots = len(self.running) - self.config.max_num_displacing_seqs + 1
        num_blocks = self.kv_cache.num_blocks_for(seq.num_tokens) - self.kv_cache.num_free_blocks
        candidates, victims = list(self.running), []
        while candidates and (num_slots > 0 or num_blocks > 0):
            victim = self.policy.pick_victim(candidates, self.running)
            if not self.waiting.may_displace(seq, victim):
                return None
            candidates.remove(victim)
            victims.append(victim)
            num_slots -= 1
            num_blocks -= self.kv_cache.num_freed_by(victim)
        if num_slots > 0 or num_blocks > 0:
            return None
        for victim in victims:
            self._preempt(victim, out)
        return seq

    def _schedule_chunk(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        self.kv_cache.allocate(seq, num_new)
        chunk = ScheduledChunk(seq, num_new, seq.num_computed_tokens)
        (out.decodes if num_new == 1 else out.prefills).append(chunk)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions_by_tenant[seq.tenant_id] += 1
        out.preempted.append(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Free the sequence's blocks and put it back at the front of its tenant's queue,
        to be recomputed."""
        self.running.remove(seq)
        self.kv_cache.free(seq)
        self._refund(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_charged_tokens = 0  # recompute is charged again
        self.waiting.push_front(seq)

    def postprocess(self, out: SchedulerOutput, sampled: list[int]) -> list[SequenceOutput]:
        """Advance every scheduled chunk; append the sampled tokens (one per sampling chunk,
        in `out.chunks` order); release the sequences that finished."""
        sampling = [chunk for chunk in out.chunks if chunk.is_sampling]
        if len(sampling) != len(sampled):
            raise RuntimeError(f"{len(sampled)} sampled tokens for {len(sampling)} sequences")
        for chunk in out.chunks:
            chunk.seq.num_computed_tokens = chunk.end
            chunk.seq.num_computed_total += chunk.num_new_tokens
            self.kv_cache.seal(chunk.seq, chunk.start)
            self.waiting.counters.served(chunk.seq, chunk.num_new_tokens)
            self._charge(chunk.seq, chunk.end)  # decodes; prefill was charged at admission
        if self.suspects and [c.seq for c in out.chunks] == [self.suspects[0]]:
            self.suspects.popleft()  # it ran alone without failing: not at fault
        outputs = []
        for chunk, token_id in zip(sampling, sampled, strict=True):
            if chunk.seq.is_finished:
                continue  # aborted while the step ran
            output = chunk.seq.append_token(token_id)
            if output.is_finished:
                self._release(chunk.seq)
            outputs.append(output)
        return outputs

    def expire(self, now_s: float) -> list[SequenceOutput]:
        """End the sequences whose queue deadline or total deadline passed by `now_s`."""
        outputs = []
        while self._deadlines and self._deadlines[0][0] < now_s:
            _, _, seq = heapq.heappop(self._deadlines)
            if seq.is_finished:
                continue
            if (output := seq.expire(now_s)) is not None:
                outputs.append(output)
                self._release(seq)
            elif seq.deadline_s is not None and seq.deadline_s >= now_s:
                # Its queue deadline passed after it had started: its total deadline is next.
                self._watch(seq, seq.deadline_s)
        return outputs

    def abort(self, request_ids: set[str]) -> list[SequenceOutput]:
        if not request_ids:
            return []
        outputs = []
        for seq in [*self.waiting, *self.running]:
            if seq.request_id in request_ids and not seq.is_finished:
                outputs.append(seq.cancel())
                self._release(seq)
        return outputs

    def _charge(self, seq: Sequence, num_tokens_until: int) -> None:
        """Charge `seq`'s tenant for computing its tokens up to `num_tokens_until`, once."""
        if num_tokens_until > seq.num_charged_tokens:
            self.waiting.counters.charge(seq, num_tokens_until - seq.num_charged_tokens)
            seq.num_charged_tokens = num_tokens_until

    def _refund(self, seq: Sequence) -> None:
        """Give back what was charged for `seq` and will not be computed (the rest of its
        prompt, when it is preempted or ends part-way through)."""
        if seq.num_charged_tokens > seq.num_computed_tokens:
            self.waiting.counters.charge(seq, seq.num_computed_tokens - seq.num_charged_tokens)
            seq.num_charged_tokens = seq.num_computed_tokens

    def _release(self, seq: Sequence) -> None:
        self.kv_cache.free(seq)
        self._refund(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif any(waiting is seq for waiting in self.waiting):
            self.waiting.remove(seq)

    def _check_invariants(self, out: SchedulerOutput) -> None:
        if len({id(chunk.seq) for chunk in out.chunks}) != len(out.chunks):
            raise RuntimeError("a sequence scheduled twice in one step")
        self.kv_cache.check(self.running)
        if any(seq.block_table for seq in self.waiting):
            raise RuntimeError("a waiting sequence holds KV blocks")
