"""OpenAI's completions and chat completions, each with grafting per request (the `kvgraft` field)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request, Response

from kvgraft.server.body import read_json
from kvgraft.server.errors import ApiError
from kvgraft.server.generation import (
    finish_reason,
    generation,
    json_reply,
    kvgraft_info,
    make_job,
    new_id,
    token_budget,
    usage,
)
from kvgraft.server.openapi import errors, json_body
from kvgraft.server.routes.deps import State, reads
from kvgraft.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    StreamOptions,
)
from kvgraft.server.streaming import stream

router = APIRouter(dependencies=[Depends(reads)])

_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}},
    "required": ["data"],
    "description": "one server-sent event: a chunk's JSON, an error's JSON, or the final `[DONE]`",
}
_STREAM = {"text/event-stream": {"schema": _EVENT}}
_GENERATION_ERRORS = errors(400, 404, 413, 429, 500, 503)


@router.post(
    "/v1/completions",
    responses={
        200: {"model": CompletionResponse, "content": _STREAM, "description": "JSON, or events with `stream`"},
        **_GENERATION_ERRORS,
    },
    openapi_extra=json_body(CompletionRequest),
)
async def completions(request: Request, state: State) -> Response:
    """Continue a prompt: one JSON reply, or server-sent events with `stream`."""
    config = state.config
    body = await read_json(request, CompletionRequest, config.max_body_bytes)
    max_tokens = token_budget(body.max_tokens, config.default_completion_tokens, config, "max_tokens")
    prompt = body.prompt_text()
    job = make_job(state, body, prompt, None, prompt, max_tokens)
    if body.stream:
        return await stream(state, job, "completion", _include_usage(body.stream_options))
    outcome = await state.run(generation(state, job, None))
    return json_reply(
        CompletionResponse(
            id=new_id("cmpl"),
            created=int(time.time()),
            model=state.model_id,
            system_fingerprint=state.system_fingerprint,
            choices=[CompletionChoice(text=outcome.result.text, finish_reason=finish_reason(outcome.result))],
            usage=usage(outcome),
            kvgraft=kvgraft_info(outcome, job.include_receipt),
        )
    )


@router.post(
    "/v1/chat/completions",
    responses={
        200: {"model": ChatCompletionResponse, "content": _STREAM, "description": "JSON, or events with `stream`"},
        **_GENERATION_ERRORS,
    },
    openapi_extra=json_body(ChatCompletionRequest),
)
async def chat_completions(request: Request, state: State) -> Response:
    """Answer a conversation: one JSON reply, or server-sent events with `stream`."""
    config = state.config
    body = await read_json(request, ChatCompletionRequest, config.max_body_bytes)
    if body.max_completion_tokens is not None and body.max_tokens is not None:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
    asked, name = (body.max_completion_tokens, "max_completion_tokens")
    if asked is None:
        asked, name = body.max_tokens, "max_tokens"
    max_tokens = token_budget(asked, config.max_tokens_limit, config, name)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    query = "\n".join(m["content"] for m in messages if m["role"] == "user")
    job = make_job(state, body, None, messages, query, max_tokens)
    if body.stream:
        return await stream(state, job, "chat", _include_usage(body.stream_options))
    outcome = await state.run(generation(state, job, None))
    return json_reply(
        ChatCompletionResponse(
            id=new_id("chatcmpl"),
            created=int(time.time()),
            model=state.model_id,
            system_fingerprint=state.system_fingerprint,
            choices=[
                ChatChoice(
                    message=AssistantMessage(content=outcome.result.text), finish_reason=finish_reason(outcome.result)
                )
            ],
            usage=usage(outcome),
            kvgraft=kvgraft_info(outcome, job.include_receipt),
        )
    )


def _include_usage(options: StreamOptions | None) -> bool:
    return options is not None and options.include_usage
