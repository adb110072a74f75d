"""Streamed replies: server-sent events in OpenAI's chunk shapes, fed by the model worker's token callback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Response
from fastapi.responses import StreamingResponse

from kvgraft.server.generation import (
    GenerationJob,
    Outcome,
    dump,
    finish_reason,
    generation,
    kvgraft_info,
    new_id,
    sse,
    usage,
)
from kvgraft.server.schemas import ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse
from kvgraft.server.state import ServerState


async def stream(
    state: ServerState, job: GenerationJob, kind: Literal["completion", "chat"], include_usage: bool
) -> Response:
    """A generation streamed as server-sent events in OpenAI's chunk shapes.

    The reply starts once the first text exists, so that every error before it (unknown graft, prompt too long,
    queue full) is still an ordinary 4xx/5xx reply; a later error ends the stream with an error event.

    Args:
        state: the server.
        job: what the request asks for.
        kind: the chunk shape, of a completion or of a chat completion.
        include_usage: end with a chunk carrying the usage (`stream_options.include_usage`).

    Returns:
        The streaming response; the generation stops if the client leaves.

    Raises:
        ApiError: the generation failed before its first text.
    """
    loop = asyncio.get_running_loop()
    channel: asyncio.Queue[str | None] = asyncio.Queue()
    cancelled = threading.Event()

    def push(delta: str) -> None:
        try:
            loop.call_soon_threadsafe(channel.put_nowait, delta)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            cancelled.set()

    ticket = state.submit(generation(state, job, push, cancelled), cancelled)
    # Settled after every delta was queued (same thread, same loop queue), so None always comes last.
    ticket.future.add_done_callback(lambda _: channel.put_nowait(None))
    try:
        first = await channel.get()
    except asyncio.CancelledError:
        ticket.cancel()
        raise
    if first is None:
        try:
            ticket.future.result()
        except BaseException as exc:
            raise state.api_error(exc) from None

    response_id = new_id("chatcmpl" if kind == "chat" else "cmpl")
    created = int(time.time())

    def chunk(
        text: str | None, finish: Literal["stop", "length"] | None = None, outcome: Outcome | None = None
    ) -> bytes:
        info = kvgraft_info(outcome, job.include_receipt) if outcome is not None else None
        common: dict[str, Any] = {
            "id": response_id,
            "created": created,
            "model": state.model_id,
            "system_fingerprint": state.system_fingerprint,
        }
        if kind == "chat":
            delta = {} if text is None else {"content": text}
            if text == "" and finish is None:
                delta = {"role": "assistant", "content": ""}
            choice = ChatChunkChoice(delta=delta, finish_reason=finish)
            return sse(dump(ChatCompletionChunk(**common, choices=[choice], kvgraft=info)))
        completion_choice = CompletionChoice(text=text or "", finish_reason=finish)
        return sse(dump(CompletionResponse(**common, choices=[completion_choice], kvgraft=info)))

    async def events() -> AsyncIterator[bytes]:
        try:
            if kind == "chat":
                yield chunk("")
            delta = first
            while delta is not None:
                yield chunk(delta)
                delta = await channel.get()
            try:
                outcome: Outcome = ticket.future.result()
            except BaseException as exc:
                # Headers are sent: the error travels as an event, which the OpenAI client raises as APIError.
                yield sse(state.api_error(exc).body())
                return
            yield chunk(outcome.tail or None, finish_reason(outcome.result), outcome)
            if include_usage:
                yield sse(
                    {
                        "id": response_id,
                        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                        "created": created,
                        "model": state.model_id,
                        "system_fingerprint": state.system_fingerprint,
                        "choices": [],
                        "usage": usage(outcome).model_dump(mode="json"),
                    }
                )
            yield sse("[DONE]")
        finally:
            if not ticket.future.done():
                ticket.cancel()  # the client went away: stop generating for it

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
