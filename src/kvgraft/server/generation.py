"""One generation request: from the validated body to a job for the model worker, and from its outcome to the
OpenAI-shaped reply (usage, finish reason, the `kvgraft` object)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from kvgraft.core.errors import BadInputError, NotFoundError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine, GenerationResult
from kvgraft.format.receipt import Receipt
from kvgraft.server.config import ServerConfig
from kvgraft.server.errors import ApiError, client_message
from kvgraft.server.grafting import GraftChoice, GraftPlan, plan_grafts
from kvgraft.server.metrics import Metrics
from kvgraft.server.prompts import TextStream, chat_prompt
from kvgraft.server.schemas import (
    GraftUsed,
    KvgraftInfo,
    KvgraftOptions,
    PromptTokensDetails,
    Usage,
    _GenerationRequest,
)
from kvgraft.server.state import ServerState
from kvgraft.server.worker import CancelledJobError


@dataclass(frozen=True)
class GenerationJob:
    """What a request asks the model for, decided before it reaches the worker."""

    prompt: str | None
    """The text to continue (completions); None for chat, whose prompt is rendered on the worker."""
    messages: list[dict[str, str]] | None
    query: str
    """What retrieval searches the library with."""
    params: SamplingParams
    choice: GraftChoice
    include_receipt: bool


@dataclass(frozen=True)
class Outcome:
    """A finished generation, with what the reply reports about it."""

    result: GenerationResult
    plan: GraftPlan
    queued_s: float
    """How long the job waited for the model worker."""
    tail: str
    """What a stream still has to send after its last delta (the final text's unsent end)."""

    @property
    def receipt(self) -> Receipt:
        """The run's receipt (kept in the server's receipt book)."""
        return self.result.receipt


# --- request to job --------------------------------------------------------------------------------------------


def unknown_model(asked: str, served: str) -> ApiError:
    """The reply to a request for a model this server does not serve.

    Args:
        asked: the model the request named.
        served: the model this server serves.

    Returns:
        A 404 `model_not_found` error.
    """
    return ApiError(
        404, f"model '{asked}' is not served here; this server serves '{served}'", param="model", code="model_not_found"
    )


def token_budget(asked: int | None, default: int, config: ServerConfig, name: str) -> int:
    """How many tokens a request may generate.

    Args:
        asked: the request's max_tokens (or max_completion_tokens), None when it gives none.
        default: the budget when it gives none.
        config: the server's limits.
        name: the request field `asked` came from, for the error.

    Returns:
        The budget.

    Raises:
        ApiError: 400 `max_tokens_too_large` when the budget is over the server's limit.
    """
    value = default if asked is None else asked
    if value > config.max_tokens_limit:
        raise ApiError(
            400,
            f"{name} is {value}; this server allows at most {config.max_tokens_limit}",
            param=name,
            code="max_tokens_too_large",
        )
    return value


def make_job(
    state: ServerState,
    body: _GenerationRequest,
    prompt: str | None,
    messages: list[dict[str, str]] | None,
    query: str,
    max_tokens: int,
) -> GenerationJob:
    """Check a generation request against what this server does, and decide its job.

    Args:
        state: the server.
        body: the validated request body.
        prompt: the text to continue (completions), None for chat.
        messages: the chat messages as {"role", "content"}, None for completions.
        query: what retrieval searches the library with.
        max_tokens: the request's token budget (`token_budget`).

    Returns:
        The job for the model worker.

    Raises:
        ApiError: an unknown model, n other than 1, or a field set to something this server cannot do.
    """
    if body.model != state.model_id:
        raise unknown_model(body.model, state.model_id)
    if body.n != 1:
        raise ApiError(400, "n must be 1: this server returns one choice per request", param="n", code="unsupported")
    unsupported = body.unsupported()
    if unsupported:
        name = unsupported[0]
        raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    options = body.kvgraft or KvgraftOptions()
    grafts = tuple(options.grafts or ())
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=body.temperature or 0.0,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed or 0,
        stop=body.stops(),
    )
    choice = GraftChoice(grafts, options.approximate, options.retrieve, options.min_score, options.min_match)
    return GenerationJob(prompt, messages, query, params, choice, options.include_receipt)


def generation(
    state: ServerState,
    job: GenerationJob,
    deltas: Callable[[str], None] | None,
    cancelled: threading.Event | None = None,
) -> Callable[[Engine], Outcome]:
    """The work of one generation, to run on the model worker.

    Args:
        state: the server.
        job: what the request asks for.
        deltas: with it, text is streamed as it is decoded, each new piece passed to it (decoding runs on the
            worker too: a fast tokenizer must not be used from two threads at once).
        cancelled: set when the client went away; the generation then stops at its next token.

    Returns:
        The function the worker calls with the engine; it returns the outcome and keeps the receipt.
    """
    enqueued = time.perf_counter()

    def run(engine: Engine) -> Outcome:
        queued_s = time.perf_counter() - enqueued
        prompt = job.prompt if job.prompt is not None else chat_prompt(engine.tokenizer, job.messages or [])
        try:
            plan = plan_grafts(
                engine,
                state.library.get,
                job.choice,
                job.query,
                prompt,
                job.params.max_new_tokens,
                state.config.retrieval_candidates,
            )
        except NotFoundError as exc:
            if job.choice.grafts:
                raise ApiError(404, state.redact(str(exc)), param="kvgraft.grafts", code="graft_not_found") from None
            raise
        stream = TextStream(engine.tokenizer, job.params.stop) if deltas is not None else None

        def on_token(token: int) -> None:
            if cancelled is not None and cancelled.is_set():
                raise CancelledJobError
            if stream is not None and deltas is not None:
                delta = stream.push(token)
                if delta:
                    deltas(delta)

        if len(plan.named) > 1:
            try:
                result = engine.generate(
                    prompt,
                    None,
                    job.params,
                    on_token=on_token,
                    graft_ids=[m.id for m in plan.named],
                    approximate=job.choice.approximate,
                )
            except BadInputError as exc:  # not one chain, or cannot be re-positioned
                message = state.redact(client_message(exc))
                raise ApiError(400, message, param="kvgraft.grafts", code="composition_refused") from None
        else:
            result = engine.generate(prompt, plan.graft_id, job.params, on_token=on_token)
        state.receipts.add(result.receipt)
        record(state.metrics, result, plan, queued_s)
        tail = stream.finish(result.text) if stream is not None else ""
        return Outcome(result, plan, queued_s, tail)

    return run


def record(metrics: Metrics, result: GenerationResult, plan: GraftPlan, queued_s: float) -> None:
    """Count one finished generation in the server's metrics.

    Args:
        metrics: the server's metrics.
        result: the generation.
        plan: the grafting it ran with.
        queued_s: how long it waited for the worker.
    """
    receipt = result.receipt
    metrics.queue_wait_seconds.observe(queued_s)
    metrics.ttft_seconds.observe(result.timings["ttft_s"])
    metrics.tokens.labels("prompt").inc(len(receipt.input_tokens))
    metrics.tokens.labels("restored").inc(receipt.graft_aligned_tokens)
    metrics.tokens.labels("completion").inc(len(result.output_tokens))
    metrics.generations.labels(plan.source or "none").inc()
    if plan.source is not None:
        metrics.graft_hits.labels(plan.source).inc()
        metrics.restore_seconds.observe(
            result.timings.get("graft_load_s", 0.0) + result.timings.get("graft_restore_s", 0.0)
        )
    elif plan.searched:
        metrics.retrieval_misses.inc()


# --- replies ---------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """A fresh reply id, e.g. `cmpl-<32 hex digits>`.

    Args:
        prefix: "cmpl" or "chatcmpl".

    Returns:
        The id.
    """
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(result: GenerationResult) -> Literal["stop", "length"]:
    """OpenAI's finish reason of a generation.

    Args:
        result: the generation.

    Returns:
        "length" when it ran out of tokens, else "stop" (a stop string or the end of text).
    """
    return "length" if result.stop_reason == "length" else "stop"


def usage(outcome: Outcome) -> Usage:
    """The token counts of a reply, from the receipt.

    Args:
        outcome: the finished generation.

    Returns:
        Prompt, completion and total tokens; the restored graft tokens count as cached prompt tokens.
    """
    receipt = outcome.receipt
    prompt = len(receipt.input_tokens)
    completion = len(receipt.output_tokens)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=receipt.graft_aligned_tokens),
    )


def kvgraft_info(outcome: Outcome, include_receipt: bool) -> KvgraftInfo:
    """The `kvgraft` object of a reply.

    Args:
        outcome: the finished generation.
        include_receipt: put the whole receipt in it, not only its id.

    Returns:
        The grafts used, the retrieval report, exactness, timings and the receipt's id and URL.
    """
    plan, result = outcome.plan, outcome.result
    grafts = []
    if plan.graft_id is not None and plan.manifest is not None and plan.source in ("request", "retrieval"):
        for manifest in plan.named or (plan.manifest,):
            grafts.append(
                GraftUsed(
                    id=manifest.id,
                    source="request" if plan.source == "request" else "retrieval",
                    tokens=len(manifest.tokens),
                    restored_tokens=manifest.aligned_tokens,
                )
            )
    receipt_id = str(outcome.receipt.id)
    return KvgraftInfo(
        grafts=grafts,
        retrieval=[c.to_json() for c in plan.retrieval],
        exact=result.exact,
        approximate=result.approximate,
        environment_differences=list(outcome.receipt.environment_differences),
        receipt_id=receipt_id,
        receipt_url=f"/v1/receipts/{receipt_id}",
        timings=dict(result.timings) | {"queue_s": outcome.queued_s},
        receipt=outcome.receipt.to_json() if include_receipt else None,
    )


def dump(model: BaseModel) -> dict[str, Any]:
    """A reply model's JSON, with the optional parts it does not carry left out rather than null.

    Args:
        model: a reply or a streamed chunk.

    Returns:
        Its JSON object.
    """
    data = model.model_dump(mode="json")
    for key in ("usage", "kvgraft"):
        if key in data and data[key] is None:
            del data[key]  # absent rather than null in chunks that do not carry them
    if isinstance(data.get("kvgraft"), dict) and data["kvgraft"].get("receipt") is None:
        data["kvgraft"].pop("receipt", None)
    return data


def json_reply(model: BaseModel, status: int = 200) -> JSONResponse:
    """A JSON reply of a reply model (`dump`).

    Args:
        model: the reply.
        status: the HTTP status.

    Returns:
        The response.
    """
    return JSONResponse(dump(model), status_code=status)


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event.

    Args:
        data: a JSON object, or a literal such as "[DONE]".

    Returns:
        The event's bytes, `data: ...` and a blank line.
    """
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
