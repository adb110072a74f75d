"""Request and response bodies, in OpenAI's shapes plus the `kvgraft` extension.

Requests are strict (a string is not a number, 1 is not true) and closed (an unknown field is an error, as with
OpenAI), so a typo never silently changes what runs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from kvgraft.library.index import IndexEntry

NonEmpty = Annotated[str, StringConstraints(min_length=1)]
SEED_MAX = 2**63 - 1
GRAFT_ID_PATTERN = r"^[0-9a-fA-F]{1,64}$"
"""A graft id or id prefix as a path parameter: hex digits only, so no id can name a path outside the store."""
RECEIPT_ID_PATTERN = r"^[0-9a-f]{64}$"


def only(schema: dict[str, Any]) -> Any:
    """A field's JSON schema replaced by `schema`: the values the server really accepts, where the type says more.

    The server refuses some typed values after parsing (`n` other than 1, a penalty other than 0); the OpenAPI
    document must not call them valid, or clients and fuzzers would send them expecting success.

    Args:
        schema: the JSON schema of the accepted values.

    Returns:
        The `json_schema_extra` of the field.
    """

    def replace(field_schema: dict[str, Any]) -> None:
        default = field_schema.get("default")
        has_default = "default" in field_schema
        field_schema.clear()
        field_schema.update(schema)
        if has_default:
            field_schema["default"] = default

    return replace


def _integral(value: Any) -> Any:
    """JSON has one number type: 8.0 is the integer 8 (as JSON Schema's "integer" says), 8.5 is no integer."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_integral)]
"""An integer field of a request: strict (a string or a bool is refused), but 8.0 is 8."""
# Constraints before the validator, so that the JSON schema shows them as minimum/maximum.
TokenCount = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX), BeforeValidator(_integral)]

_ZERO_OR_NULL = {"enum": [0, None]}
_NULL = {"type": "null"}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class KvgraftOptions(_Request):
    """The `kvgraft` field of a completion request (the official client sends it with `extra_body`)."""

    grafts: list[NonEmpty] | None = None
    """Graft ids or unique id prefixes to restore before the prompt, in order: exact when they form one chain."""
    approximate: bool = False
    """Allow grafts that are not one chain, re-positioned one after another (never exact; labelled so)."""
    retrieve: bool = True
    """With no graft named: graft the library's best graft for the prompt, if one is usable."""
    min_score: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    """Least retriever score (BM25 by default) of a retrieved graft's best-matching text."""
    min_match: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    """Least word overlap (Jaccard, 0..1) between the prompt and that text."""
    include_receipt: bool = False
    """Put the whole receipt in the reply, not only its id."""


class StreamOptions(_Request):
    include_usage: bool = False


class _GenerationRequest(_Request):
    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: JsonInt = Field(default=1, json_schema_extra=only({"type": "integer", "enum": [1]}))
    presence_penalty: float | None = Field(default=None, json_schema_extra=only(_ZERO_OR_NULL))
    frequency_penalty: float | None = Field(default=None, json_schema_extra=only(_ZERO_OR_NULL))
    logit_bias: dict[str, float] | None = Field(
        default=None, json_schema_extra=only({"anyOf": [{"type": "object", "maxProperties": 0}, _NULL]})
    )
    user: str | None = None
    kvgraft: KvgraftOptions | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> list[str]:
        """Fields set to something this server cannot do (they are refused rather than ignored)."""
        found = []
        if self.presence_penalty:
            found.append("presence_penalty")
        if self.frequency_penalty:
            found.append("frequency_penalty")
        if self.logit_bias:
            found.append("logit_bias")
        return found


class CompletionRequest(_GenerationRequest):
    # The schema says non-empty: an empty prompt is refused (400) unless `kvgraft.grafts` names a graft to continue.
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] = Field(
        description="The text to continue, one string or a list of one. It must be non-empty unless "
        "kvgraft.grafts names grafts to continue, and its tokens plus max_tokens must fit the model's positions "
        "(else 400).",
        json_schema_extra=only(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                ]
            }
        ),
    )
    max_tokens: TokenCount | None = None
    echo: bool = Field(default=False, json_schema_extra=only({"type": "boolean", "enum": [False]}))
    logprobs: JsonInt | None = Field(default=None, json_schema_extra=only(_NULL))
    best_of: JsonInt | None = Field(default=None, json_schema_extra=only({"enum": [1, None]}))
    suffix: str | None = Field(
        default=None, json_schema_extra=only({"anyOf": [{"type": "string", "maxLength": 0}, _NULL]})
    )

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def unsupported(self) -> list[str]:
        found = super().unsupported()
        if self.echo:
            found.append("echo")
        if self.logprobs is not None:
            found.append("logprobs")
        if self.best_of not in (None, 1):
            found.append("best_of")
        if self.suffix:
            found.append("suffix")
        return found


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Messages echoed back from an earlier reply carry fields such as `refusal`; they are harmless to ignore.
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Request):
    type: Literal["text"]


class ChatCompletionRequest(_GenerationRequest):
    # Both token budgets at once are refused (400): the schema says so, for clients and fuzzers.
    model_config = ConfigDict(
        json_schema_extra={
            "not": {
                "required": ["max_tokens", "max_completion_tokens"],
                "properties": {"max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}},
            }
        }
    )
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = Field(default=None, json_schema_extra=only({"enum": [False, None]}))
    top_logprobs: JsonInt | None = Field(default=None, json_schema_extra=only(_NULL))
    response_format: ResponseFormat | None = None

    def unsupported(self) -> list[str]:
        found = super().unsupported()
        if self.logprobs:
            found.append("logprobs")
        if self.top_logprobs is not None:
            found.append("top_logprobs")
        return found


class GraftCreateRequest(_Request):
    text: str = Field(
        json_schema_extra=only({"type": "string", "pattern": r"\S"}),
        description="The text to build a graft of: not blank, and its tokens must fit the model's positions "
        "(else 400).",
    )
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free JSON kept in the manifest; a `summary` or `title` is what retrieval finds the graft by."""
    after: NonEmpty | None = None
    """A graft (id or prefix) to continue: the new graft holds its tokens then `text`, one exact chain."""


# --- responses ------------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class GraftUsed(BaseModel):
    id: str
    source: Literal["request", "retrieval"]
    tokens: int
    restored_tokens: int


class KvgraftInfo(BaseModel):
    grafts: list[GraftUsed]
    retrieval: list[dict[str, Any]]
    exact: bool
    approximate: bool = False
    environment_differences: list[str]
    receipt_id: str
    receipt_url: str
    timings: dict[str, float]
    receipt: dict[str, Any] | None = None


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kvgraft: KvgraftInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    kvgraft: KvgraftInfo


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    kvgraft: KvgraftInfo | None = None


class GraftSummary(BaseModel):
    """One graft of the library, as `GET /v1/grafts` lists it."""

    object: Literal["graft"] = "graft"
    id: str
    tokens: int
    aligned_tokens: int
    bytes: int
    model: str
    kind: str | None = None
    title: str | None = None

    @classmethod
    def of(cls, entry: IndexEntry, **extra: Any) -> Self:
        """The row of a graft: the one place every graft reply takes its common fields from.

        Args:
            entry: the graft's index entry (`IndexEntry.of(manifest, size)` for a graft at hand).
            **extra: the fields a subclass adds (`manifest`, `created`).

        Returns:
            The row; a kind or title that is not a string is left out (metadata is free JSON).
        """
        return cls(
            id=entry.id,
            tokens=entry.tokens,
            aligned_tokens=entry.aligned_tokens,
            bytes=entry.bytes,
            model=entry.model_name,
            kind=_str_or_none(entry.kind),
            title=_str_or_none(entry.title),
            **extra,
        )


class GraftDetail(GraftSummary):
    """One graft with its whole manifest (`GET /v1/grafts/{id}`)."""

    manifest: dict[str, Any]


class GraftCreated(GraftSummary):
    """A stored graft (`POST /v1/grafts`); `created` is False when it was there already."""

    created: bool


class GraftList(BaseModel):
    object: Literal["list"] = "list"
    data: list[GraftSummary]
    has_more: bool


class GraftDeleted(BaseModel):
    """The reply of `DELETE /v1/grafts/{id}`."""

    id: str
    object: Literal["graft.deleted"] = "graft.deleted"
    deleted: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """`GET /health`: "ok" (200) while the model worker runs, "unavailable" (503) once it stopped."""

    status: Literal["ok", "unavailable"]
    model: str
    queue_depth: int
    max_queue: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error reply: `{"error": {"message", "type", "param", "code"}}`, as OpenAI's."""

    error: ErrorDetail


def _str_or_none(value: object) -> str | None:
    return str(value) if isinstance(value, str) else None
