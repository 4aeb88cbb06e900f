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
- With an ITL target, a step beside decodes carries at most `guard_tokens` of prompt work,
  learnt by feedback. Every decode of a step waits for the whole step, so a step within the
  target is each of its tokens' ITL within it. A step is its decodes' time plus its prompt
  tokens' (the latest step of decodes alone says what the decodes cost, or where a step
  with no decodes came since, what its prompt tokens cost): a step that ran over the target
  cuts the guard to the prompt tokens that fit in what the target leaves beside the
  decodes, at the prompt part's measured cost; a step with no decodes (a burst's first)
  sizes it before any decode waits; a step that used its whole guard well under the target
  (below 80%) grows it by a quarter; within [`MIN_TOKENS`, `prefill_tokens`].
- The target yields to the prompts where the decodes are a large part of every step (long
  prompts beside long-context decodes): the guard keeps a step's prompt part at least
  `MIN_PROMPT_TO_DECODES` times its decodes' part, taken again at every step over the
  target: a burst's first tokens join the decodes of every step while its backlog drains,
  and a guard cut beside its first few decodes would otherwise stay that small (on a CPU
  without AVX-512, session 41, ~35 tokens beside 17 decodes: a third of every step for the
  backlog, and its last first token ~28% later). Cutting a backlog into ever smaller steps,
  each also paying for every decode, would stretch every waiting prompt's first token for
  the sake of the streams' next ones; and where the decodes alone take the target, no
  prompt budget meets it. The guard matters most for a backlog's large steps: on this
  project's CPUs a 2,048-token step beside decodes is 0.3-0.6 s, the ITL p99 of a burst;
  the default target (`itl_target_ms`, `worker/config.py`) cuts those steps on a CPU and
  never binds on a GPU, where such a step is milliseconds.
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

MIN_TOKENS = 32  # the guard never goes below this many prompt tokens: prompts keep moving
GROW_BELOW = 0.8  # of the target: a full step this fast may take more tokens
GROWTH = 1.25
# The ITL target never cuts a step's prompt part below this many times its decodes' part:
# every step beside decodes also pays for them, so a backlog cut into ever smaller steps
# would spend most of its time on decodes while its prompts wait (long prompts beside
# long-context decodes); at 3, a backlog's prompt work keeps at least three quarters of
# the time of every step.
MIN_PROMPT_TO_DECODES = 3.0
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
        # The most prompt tokens a step beside decodes may carry: learnt from the ITL target,
        # if any, starting high (the first step over the target cuts it).
        self.guard_tokens = self.prefill_tokens
        # What the steps measured: the latest step of decodes alone (None: none since the
        # latest step with no decodes), and a prompt token's time in the latest step with no
        # decodes (None: none yet). A step's decodes' part is taken from the later of the two.
        self.decodes_s: float | None = None
        self.prompt_token_s: float | None = None
        self.shared_tokens = shared_tokens

    def for_step(self, num_decodes: int, is_shared: bool = False, waiting_tokens: int = 0) -> int:
        """The budget (decodes and prompt tokens) of a step with `num_decodes` decodes, shared
        by several tenants or not, with `waiting_tokens` of prompt work not yet computed
        (admitted or waiting)."""
        if not num_decodes:
            budget = self.prefill_tokens
        elif waiting_tokens > DRAIN_STEPS * self.decode_tokens:
            budget = min(self.prefill_tokens, num_decodes + self.guard_tokens)
        else:
            budget = min(self.decode_tokens, num_decodes + self.guard_tokens)
        if is_shared and self.shared_tokens is not None:
            return min(budget, self.shared_tokens)
        return budget

    def observe(self, num_tokens: int, budget: int, num_decodes: int, seconds: float) -> None:
        """A step of `num_tokens` (of `budget`), `num_decodes` of them decodes, took `seconds`.
        A step with no decodes made no ITL wait, but says what prompt tokens cost."""
        target_s = self.itl_target_s
        num_prompt = num_tokens - num_decodes
        if target_s is None or seconds <= 0:
            return
        if not num_prompt:
            self.decodes_s = seconds
            return
        if not num_decodes:
            self.decodes_s, self.prompt_token_s = None, seconds / num_prompt
        decodes_s = self._decodes_part(num_prompt, num_decodes, seconds)
        # beside decodes, the whole budget used, the guard's worth of prompt tokens in it
        is_full = num_decodes > 0 and num_tokens >= budget and num_prompt >= self.guard_tokens
        if seconds > target_s:
            within, floor = _prompt_tokens_within(
                target_s, num_prompt, seconds - decodes_s, decodes_s
            )
            # cut to the target, but never below the floor beside these decodes
            self.guard_tokens = min(self.prefill_tokens, max(min(self.guard_tokens, within), floor))
        elif is_full and seconds < GROW_BELOW * target_s:  # well under the target: grow
            grown = max(self.guard_tokens + 1, int(self.guard_tokens * GROWTH))
            self.guard_tokens = min(self.prefill_tokens, grown)

    def _decodes_part(self, num_prompt: int, num_decodes: int, seconds: float) -> float:
        """The decodes' share of a step's `seconds`: the latest step of decodes alone, or
        where none came after the latest step with no decodes, what its prompt tokens'
        cost leaves (0 before either was seen)."""
        if not num_decodes:
            return 0.0
        if self.decodes_s is not None and self.decodes_s < seconds:
            return self.decodes_s
        if self.prompt_token_s is not None:
            return max(0.0, seconds - num_prompt * self.prompt_token_s)
        return 0.0


def _prompt_tokens_within(
    target_s: float, num_prompt: int, prompt_s: float, decodes_s: float
) -> tuple[int, int]:
    """The prompt tokens that fit beside `decodes_s` of decodes within `target_s`, when
    `num_prompt` of them took `prompt_s` (at least `MIN_TOKENS`), and the floor: the prompt
    tokens that take `MIN_PROMPT_TO_DECODES` times the decodes' time (where the decodes alone
    take the target, no prompt budget meets it: the prompts then keep three quarters of
    every step)."""
    token_s = prompt_s / num_prompt
    within = (target_s - decodes_s) / token_s
    return max(MIN_TOKENS, int(within)), int(MIN_PROMPT_TO_DECODES * decodes_s / token_s)
