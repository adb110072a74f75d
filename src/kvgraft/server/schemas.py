"""Request and response bodies, in OpenAI's shapes plus the `kvgraft` extension.

Requests are strict (a string is not a number, 1 is not true) and closed (an unknown field is an error, as with
OpenAI), so a typo never silently changes what runs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from kvgraft.library.index import IndexEntry

NonEmpty = Annotated[str, StringConstraints(min_length=1)]
SEED_MAX = 2**63 - 1


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
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
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
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: int | None = Field(default=None, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

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
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> list[str]:
        found = super().unsupported()
        if self.logprobs:
            found.append("logprobs")
        if self.top_logprobs is not None:
            found.append("top_logprobs")
        return found


class GraftCreateRequest(_Request):
    text: str
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


def _str_or_none(value: object) -> str | None:
    return str(value) if isinstance(value, str) else None
