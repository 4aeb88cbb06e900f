"""Request bodies of the OpenAI-compatible endpoints, validated with pydantic."""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request

from api.errors import APIError, bad_request


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationBody(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str = Field(validation_alias=AliasChoices("model", "model_id"), min_length=1)
    max_tokens: int | None = Field(default=None, gt=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False  # extension, for benchmarks: generate exactly max_tokens
    stop_token_ids: list[int] = Field(default_factory=list, max_length=16)  # extension (vLLM's)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(GenerationBody):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: str | list[int]) -> str | list[int]:
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


BodyT = TypeVar("BodyT", bound=BaseModel)


def parse_body(model: type[BodyT], raw: bytes) -> BodyT:
    """Validate a JSON body, turning the first problem into a 400 that names the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _to_api_error(exc) from None


def _to_api_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return bad_request("The request body is not valid JSON.", code="invalid_json")
    # The top-level field is the param; deeper parts of `loc` name union members, not fields.
    param = str(first["loc"][0]) if first["loc"] else None
    message = first["msg"]
    if param:
        message = f"{param}: {message}"
    return bad_request(message, param=param, code="invalid_value")


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The raw body, or 413 as soon as it is known to exceed `limit_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise _too_large(limit_bytes)
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise _too_large(limit_bytes)
    return body


def _too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"The request body exceeds {limit_bytes} bytes.", code="request_too_large")
