"""Request bodies of the OpenAI-compatible endpoints, validated with pydantic.

Numbers are bounded so that whatever passes, the worker can use: no NaN or infinity, a seed
that fits torch's generator, a temperature that cannot overflow the logits (float32 logits
of ~30 divided by 5e-324 are infinite, and the step fails). Fields of OpenAI's API (and
vLLM's extensions) that llmfleet does not honour are refused, 400 `unsupported_parameter`,
unless they hold the value that asks for nothing (`NO_OP_VALUES`: `n: 1`, `echo: false`,
`logprobs: null`, ...), which frameworks send even when unset. Other unknown fields are
ignored, as OpenAI's and vLLM's APIs do.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError
from starlette.requests import Request

from api.errors import APIError, bad_request

MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit integer
# Below it (and above 0, greedy) a temperature is refused: float32 logits divided by 1e-40
# overflow. 0.01 keeps them finite for any logit below 3e36 and is, in effect, greedy.
MIN_TEMPERATURE = 0.01

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationBody(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)

    # Parameters llmfleet does not honour, each with the values that ask for nothing.
    NO_OP_VALUES: ClassVar[dict[str, tuple[object, ...]]] = {
        "n": (1, None),
        "logit_bias": (None, {}),
        "presence_penalty": (None, 0),
        "frequency_penalty": (None, 0),
        "repetition_penalty": (None, 1),  # vLLM's extensions from here on
        "min_p": (None, 0),
        "min_tokens": (None, 0),
        "use_beam_search": (None, False),
    }

    model: str = Field(validation_alias=AliasChoices("model", "model_id"), min_length=1)
    max_tokens: int | None = Field(default=None, gt=0, le=MAX_INT32)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=MAX_INT32)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    ignore_eos: bool = False  # extension, for benchmarks: generate exactly max_tokens
    # OpenAI's end-user id. Here it only keeps one user's requests on one version of the model
    # during a rollout sticky by user (`shared/routing.py`); it is not stored.
    user: str | None = Field(default=None, max_length=256)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=16)  # vLLM's
    n: Any = 1
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    use_beam_search: Any = None

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise PydanticCustomError(
                "temperature_too_small",
                "must be 0 (greedy) or at least {minimum}",
                {"minimum": MIN_TEMPERATURE},
            )
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _no_op_if_unsupported(cls, value: object, info: ValidationInfo) -> object:
        no_op_values = cls.NO_OP_VALUES.get(info.field_name or "")
        if no_op_values is not None and value not in no_op_values:
            allowed = " or ".join(json.dumps(v) for v in no_op_values)
            raise PydanticCustomError(
                "unsupported_parameter",
                "not supported by this API; leave it out, or send {allowed}",
                {"allowed": allowed},
            )
        return value

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
    NO_OP_VALUES: ClassVar[dict[str, tuple[object, ...]]] = {
        **GenerationBody.NO_OP_VALUES,
        "logprobs": (None,),  # 0 asks for the sampled tokens' log probabilities
        "echo": (None, False),
        "best_of": (None, 1),
        "suffix": (None, ""),
    }

    prompt: str | list[int]
    logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """OpenAI's API also takes a list of prompts (strings or token lists), and clients
        such as LangChain's send one prompt that way: a list of one is that prompt; several
        in one request are refused, as `n > 1` is (one request, one stream, one usage)."""
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) > 1:
                raise PydanticCustomError(
                    "unsupported_parameter",
                    "several prompts in one request are not supported; send one request per prompt",
                )
            return value[0]
        return value

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
    NO_OP_VALUES: ClassVar[dict[str, tuple[object, ...]]] = {
        **GenerationBody.NO_OP_VALUES,
        "logprobs": (None, False),
        "top_logprobs": (None, 0),
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "functions": (None, []),
        "function_call": (None, "none"),
        "response_format": (None, {"type": "text"}),
        "audio": (None,),
        "modalities": (None, ["text"]),
        "prediction": (None,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0, le=MAX_INT32)
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

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
    code = "unsupported_parameter" if first["type"] == "unsupported_parameter" else "invalid_value"
    return bad_request(message, param=param, code=code)


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
