"""A request's in-flight generation state, held only in the worker's memory."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.protocol import ErrorCode, FinishReason, QueuedRequest, SamplingParams
from worker.detokenizer import Decoder, IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    code: ErrorCode
    message: str


@dataclass(slots=True)
class SequenceOutput:
    """What one engine step produced for one sequence."""

    request_id: str
    text: str
    num_new_tokens: int
    finish_reason: FinishReason | None  # once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int = 0  # all tokens computed, recompute after preemption included
    error: ErrorInfo | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, eq=False)  # identity, not field-by-field equality
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    arrival_s: float = 0.0
    tenant_id: str = ""
    tier: int = 1
    weight: int = 1
    queue_deadline_s: float | None = None  # unix times, see QueuedRequest
    deadline_s: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # Continuous batching: how many of this sequence's tokens are in the KV cache, and where.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix caching: full blocks'
    num_preemptions: int = 0
    # Fair queuing: tokens of this pass charged to the tenant, and all tokens ever computed
    # (prompt, decodes and recompute after preemptions).
    num_charged_tokens: int = 0
    num_computed_total: int = 0
    num_failures: int = 0  # model steps that failed with this sequence alone in them

    @classmethod
    def from_request(
        cls, request: QueuedRequest, decoder: Decoder, eos_token_ids: frozenset[int]
    ) -> Sequence:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            eos_token_ids=eos_token_ids,
            detokenizer=IncrementalDetokenizer(decoder, request.sampling.stop),
            arrival_s=request.arrival_ts,
            tenant_id=request.tenant_id,
            tier=request.tier,
            weight=request.weight,
            queue_deadline_s=request.queue_deadline_ts,
            deadline_s=request.deadline_ts,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_max_tokens(self) -> int:
        """The most tokens this sequence can ever hold: prompt plus max_tokens."""
        return self.num_prompt_tokens + self.sampling.max_tokens

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole list."""
        num_prompt = self.num_prompt_tokens
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def adopt_first_token(self, token_id: int) -> None:
        """The first output token, sampled by the worker that computed the prompt (a
        prefill/decode hand-off): recorded, and fed to the detokenizer so the text of the
        tokens after it decodes as it would have here; its own text that worker sent."""
        if self.output_token_ids:
            raise RuntimeError("adopt_first_token of a sequence that has output")
        self.output_token_ids.append(token_id)
        self.detokenizer.add_token(token_id)

    def append_token(self, token_id: int) -> SequenceOutput:
        """Record a sampled token, decide whether the sequence is done, and say what to send."""
        self.output_token_ids.append(token_id)
        if self._is_stop_token(token_id):
            return self._finish(FinishReason.STOP, self.detokenizer.flush())
        text = self.detokenizer.add_token(token_id)
        if self.detokenizer.is_stopped:
            return self._finish(FinishReason.STOP, text)
        if self.num_output_tokens >= self.sampling.max_tokens:
            text += self.detokenizer.flush()
            reason = FinishReason.STOP if self.detokenizer.is_stopped else FinishReason.LENGTH
            return self._finish(reason, text)
        return self._output(text, num_new_tokens=1)

    def cancel(self) -> SequenceOutput:
        return self._finish(FinishReason.CANCELLED, "", num_new_tokens=0)

    def expire(self, now_s: float) -> SequenceOutput | None:
        """End the sequence if a deadline passed: `queue_timeout` (an error) if it never
        started, finish reason `deadline` if it did."""
        is_started = self.num_output_tokens > 0
        if not is_started and self.queue_deadline_s is not None and now_s > self.queue_deadline_s:
            return self.refuse(
                ErrorCode.QUEUE_TIMEOUT, "the request waited past its queue deadline"
            )
        if self.deadline_s is not None and now_s > self.deadline_s:
            return self._finish(FinishReason.DEADLINE, self.detokenizer.flush(), num_new_tokens=0)
        return None

    def refuse(self, code: ErrorCode, reason: str) -> SequenceOutput:
        """End a sequence that cannot be served (e.g. it would never fit the KV cache)."""
        output = self._finish(FinishReason.ERROR, "", num_new_tokens=0)
        output.error = ErrorInfo(code, reason)
        return output

    def _is_stop_token(self, token_id: int) -> bool:
        if token_id in self.sampling.stop_token_ids:
            return True
        return token_id in self.eos_token_ids and not self.sampling.ignore_eos

    def _finish(self, reason: FinishReason, text: str, num_new_tokens: int = 1) -> SequenceOutput:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        return self._output(text, num_new_tokens)

    def _output(self, text: str, num_new_tokens: int) -> SequenceOutput:
        return SequenceOutput(
            request_id=self.request_id,
            text=text,
            num_new_tokens=num_new_tokens,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_computed_tokens=self.num_computed_total,
        )
