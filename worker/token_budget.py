"""The step's token budget: time to first token and inter-token latency tuned apart.

Plain Python, no torch, no clock of its own: the scheduler tells it how much prompt work is
waiting, and the engine reports each step's duration.

- A step in which no sequence decodes (a burst of new prompts, nothing yet streaming) takes
  up to `prefill_tokens` (`--max-num-prefill-tokens`): the burst is prefilled in few large
  steps, and nobody's next token waits on them.
- A step beside decodes takes `decode_tokens` (`--max-num-batched-tokens`) while little
  prompt work waits: a new prompt or two start without stretching anyone's next token. When
  more waits than `DRAIN_STEPS` such steps would clear (a burst that arrived while others
  stream), the step takes up to `prefill_tokens` of it: the backlog's first tokens come in a
  few large steps, not dozens of small ones each also paying for every running decode. The
  decodes then wait on a few long steps (vLLM's CPU default takes 2,048 tokens in every
  step, backlog or not).
- With an ITL target, a step beside decodes takes at most `guard_tokens`, learnt by
  feedback: a step that ran over the target shrinks it in proportion, and a step that used
  a budget as large as the guard, well under the target (below 80%), grows it by a quarter,
  within [`MIN_TOKENS`, `prefill_tokens`]. Every decode of a step waits for the whole step,
  so a step within the target is each of its tokens' ITL within it.
- While more than one tenant has work (in the batch or its queue, or had within the
  scheduler's `shared_window_s`), a step takes at most
  `shared_tokens` (`--shared-batched-tokens`): a larger step is more throughput and an
  earlier first token for the prompts it carries, paid by every token that waits for it;
  when that is another tenant's next token, or a newcomer's first (issue 15's burst-fill:
  a 384-token step made a light tenant's TTFT p99 3.4x its value alone against 2.4x at 192,
  docs/benchmarks.md), isolation wins. A tenant that arrives while a step runs still waits
  for that step.
"""

from __future__ import annotations

MIN_TOKENS = 32  # a budget beside decodes never goes below this: prompts keep moving
GROW_BELOW = 0.8  # of the target: a full step this fast may take more tokens
GROWTH = 1.25
# Beside decodes, prompt work beyond this many steps of `decode_tokens` is a backlog that
# takes the large steps.
DRAIN_STEPS = 2


class TokenBudget:
    def __init__(
        self,
        decode_tokens: int,
        prefill_tokens: int | None,
        itl_target_s: float | None,
        shared_tokens: int | None = None,
    ) -> None:
        self.prefill_tokens = max(decode_tokens, prefill_tokens or decode_tokens)
        self.itl_target_s = itl_target_s
        self.decode_tokens = decode_tokens
        # The most a step beside decodes may take: learnt from the ITL target, if any,
        # starting high (the first step over the target shrinks it in proportion).
        self.guard_tokens = self.prefill_tokens
        self.shared_tokens = shared_tokens

    def for_step(self, has_decodes: bool, is_shared: bool = False, waiting_tokens: int = 0) -> int:
        """The budget of a step with decodes in it or none, shared by several tenants or not,
        with `waiting_tokens` of prompt work not yet computed (admitted or waiting)."""
        if not has_decodes:
            budget = self.prefill_tokens
        elif waiting_tokens > DRAIN_STEPS * self.decode_tokens:
            budget = min(self.prefill_tokens, self.guard_tokens)
        else:
            budget = min(self.decode_tokens, self.guard_tokens)
        if is_shared and self.shared_tokens is not None:
            return min(budget, self.shared_tokens)
        return budget

    def observe(self, num_tokens: int, budget: int, has_decodes: bool, seconds: float) -> None:
        """A step of `num_tokens` (of `budget`) took `seconds`."""
        if self.itl_target_s is None or not has_decodes or seconds <= 0:
            return
        if seconds > self.itl_target_s:
            scaled = int(num_tokens * self.itl_target_s / seconds)
            self.guard_tokens = max(MIN_TOKENS, min(self.guard_tokens, scaled))
        elif num_tokens >= budget >= self.guard_tokens and seconds < GROW_BELOW * self.itl_target_s:
            grown = max(self.guard_tokens + 1, int(self.guard_tokens * GROWTH))
            self.guard_tokens = min(self.prefill_tokens, grown)
