"""What travels over Redis between the API and the workers: JSON, never pickle.

`QueuedRequest` is the body of a stream entry; `Event` subclasses are the messages on a
request's pub/sub channel. Each carries a `seq` so a reader can tell a gap.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from shared.keys import deployment_name


class FinishReason(StrEnum):
    """Why a request ended: a final event's `finish_reason` (all but `error`), and the
    usage ledger's."""

    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens
    CANCELLED = "cancelled"  # the client went away
    DEADLINE = "deadline"  # the request's deadline passed while it ran
    ERROR = "error"  # ended by an error event


class ErrorCode(StrEnum):
    """An error event's `code`. New codes reach the API before the workers send them (the
    API decodes events with this enum)."""

    INVALID_SAMPLING_PARAMS = "invalid_sampling_params"  # the client's: HTTP 400
    INVALID_PROMPT = "invalid_prompt"  # the client's: HTTP 400
    KV_CACHE_CAPACITY = "kv_cache_capacity"  # can never fit this worker's KV cache
    QUEUE_TIMEOUT = "queue_timeout"  # waited past its queue deadline
    MODEL_ERROR = "model_error"  # the model step failed on it alone, repeatedly
    SAMPLING_ERROR = "sampling_error"  # its sampling failed (e.g. NaN logits)
    WORKER_LOST = "worker_lost"  # its worker stopped heartbeating mid-stream
    WORKER_SHUTDOWN = "worker_shutdown"  # its worker shut down before it finished


# The errors a client's request causes (an HTTP 400 for it), not the server.
CLIENT_ERROR_CODES = frozenset({ErrorCode.INVALID_SAMPLING_PARAMS, ErrorCode.INVALID_PROMPT})


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True)

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class QueuedRequest(BaseModel):
    """A request accepted by the API, as it waits on its tenant's stream."""

    request_id: str
    tenant_id: str
    tier: int = 1  # the tenant's priority tier and fair-share weight when it was admitted
    weight: int = 1
    model: str
    # The version that serves it (`deployment_id` is its row), chosen by the API: its
    # queue is that version's (`deployment_name`), and its usage names the deployment.
    version: str = "1"
    deployment_id: int
    kind: Literal["completion", "chat"]
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_ts: float
    # Unix times: not started by then, it fails with `queue_timeout` without using the GPU;
    # not finished by then, it ends with finish reason `deadline`.
    queue_deadline_ts: float | None = None
    deadline_ts: float | None = None
    # The tenant's retention policy when it was admitted: days its prompt and output are
    # kept (sent with its usage event); None: they are never stored.
    content_retention_days: int | None = None

    @property
    def deployment_name(self) -> str:
        """`model@version`: the version whose streams the request waits on."""
        return deployment_name(self.model, self.version)

    def to_fields(self) -> dict[str, str]:
        return {"body": self.model_dump_json()}

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> QueuedRequest:
        # No body: "" is invalid JSON, a ValidationError like any other malformed body.
        body = fields.get(b"body", fields.get("body", ""))
        return cls.model_validate_json(body)


class UsageEvent(BaseModel):
    """A finished request's usage, from whoever ended it to the control process (an arq job
    argument, JSON) that writes it to the ledger once (`shared/usage.py`)."""

    request_id: str
    tenant_id: str
    deployment_id: int
    kind: Literal["completion", "chat"]
    sampling: SamplingParams
    input_tokens: int
    output_tokens: int  # delivered: what is billed
    computed_tokens: int  # prompt, decodes and recompute after preemptions: the cost
    finish_reason: FinishReason
    arrival_ts: float
    finished_ts: float
    # Only under a retention policy: the prompt (token ids: the publisher holds no
    # tokenizer) and the output text, kept `content_retention_days`.
    content_retention_days: int | None = None
    prompt_token_ids: list[int] | None = None
    output_text: str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenEvent(BaseModel):
    type: Literal["token"] = "token"
    seq: int
    text: str
    num_tokens: int


class FinalEvent(BaseModel):
    """The last event of a finished request: its last text delta, why it ended, its usage."""

    type: Literal["final"] = "final"
    seq: int
    text: str = ""
    finish_reason: Literal[
        FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED, FinishReason.DEADLINE
    ]
    usage: Usage


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    seq: int
    code: ErrorCode
    message: str


Event = Annotated[TokenEvent | FinalEvent | ErrorEvent, Field(discriminator="type")]
_event_adapter: TypeAdapter[Event] = TypeAdapter(Event)


def encode_event(event: TokenEvent | FinalEvent | ErrorEvent) -> str:
    return event.model_dump_json()


def decode_event(data: bytes | str) -> TokenEvent | FinalEvent | ErrorEvent:
    return _event_adapter.validate_json(data)


def encode_cancel(request_id: str) -> str:
    return json.dumps({"request_id": request_id})


def decode_cancel(data: bytes | str) -> str:
    request_id: str = json.loads(data)["request_id"]
    return request_id
