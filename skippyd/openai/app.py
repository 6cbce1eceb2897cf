"""The OpenAI-compatible HTTP API of the head, as a plain ASGI application.

    GET  /v1/models, /v1/models/{id}
    POST /v1/chat/completions          messages through the model's chat template
    POST /v1/completions               a raw prompt (string or token ids)
    GET  /health                       200, or 503 while loading or draining
    GET  /metrics                      Prometheus text format

Other routes (the web console's, skippyd.openai.console) are mounted beside
these with :meth:`OpenAIApp.mount`. Every request passes the listener's access
rules first (skippyd.openai.auth): with an API key set, /v1/* needs it (401
otherwise), /health never does.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad body or a prompt that does not fit (an image the
head cannot take included), 413 for an image over the head's size or pixel
limit, 404 for an unknown model or path, 503 with ``Retry-After`` while
draining or when the engine found no place for the generation within its
queue timeout.

Every generation runs in a nursery beside a task that waits for the client's
``http.disconnect``: a client that goes away cancels its generation, and the
engine's own cleanup frees the session on every stage. A streamed response
starts (status 200 and headers) only with its first piece, so anything that
fails before a token exists (a prompt too long, no lane) is still an honest
status code; what fails later is an ``error`` event in the stream.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from skippyd.head.engine import (
    Draining,
    FinishReason,
    GenerationError,
    GenerationRequest,
    GenerationResult,
    ImageRefused,
    PromptTooLong,
    QueueTimeout,
)
from skippyd.head.piece_relay import ClientStalled, PieceRelay
from skippyd.head.sink import DISCARD
from skippyd.openai import schemas, tools
from skippyd.openai.auth import Access, Need, Refused
from skippyd.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from skippyd.openai.metrics import Metrics
from skippyd.ports import NodeView
from skippyd.runtime.llama import LlamaError
from skippyd.telemetry import span

log = logging.getLogger("skippyd.openai")

MAX_BODY_BYTES = 4 * 1024 * 1024
INLINE_BODY_BYTES = 256 * 1024  # a body this large or larger is parsed in a worker thread
RETRY_AFTER_S = 1
JSON = b"application/json"


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None, close: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.close = close  # the connection cannot be reused (e.g. a request body left unread)
        self.headers: list[tuple[bytes, bytes]] = []  # more headers for the answer

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_generation(cls, exc: GenerationError) -> ApiError:
        if isinstance(exc, ImageRefused):
            return cls(exc.status, str(exc), param=exc.source, code=exc.code)
        if isinstance(exc, QueueTimeout):
            return cls(503, str(exc), code="no_lane", retry_after=RETRY_AFTER_S)
        if isinstance(exc, Draining):
            return cls(503, "the server is draining: no new generations", code="draining", retry_after=RETRY_AFTER_S)
        if exc.status == 400:
            return cls(400, str(exc), code="context_length_exceeded" if "context" in str(exc) else "invalid_value")
        status = exc.status if exc.status >= 500 else 500
        if exc.retryable:  # draining, no lane, a stage unreachable: worth trying again shortly
            return cls(status if status != 500 else 503, str(exc), code="unavailable", retry_after=RETRY_AFTER_S)
        return cls(status, str(exc), code="generation_failed")


class _ClientGone(Exception):
    """The client disconnected before the answer was complete."""


class Exchange:
    """One HTTP request and its response on the ASGI channel."""

    def __init__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]):
        self.scope, self._receive, self._send = scope, receive, send
        self.id = secrets.token_hex(12)
        self.method = scope.get("method", "GET")
        self.path = scope.get("path", "/")
        self.status: int | None = None  # set when the response starts
        self.disconnected = False
        self.finished = False

    def header(self, name: bytes) -> str | None:
        """The request's header ``name`` (lower case), or None."""
        for key, value in self.scope.get("headers", ()):
            if key == name:
                return value.decode("latin-1")
        return None

    async def body(self, limit: int = MAX_BODY_BYTES) -> bytes:
        chunks, size = [], 0
        while True:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                self.disconnected = True
                raise _ClientGone()
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:  # the rest stays unread: the server closes the connection after the answer
                raise ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large",
                               close=True)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    async def wait_disconnect(self) -> None:
        """Return when the client goes away (call only once the body has been read)."""
        while True:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                self.disconnected = True
                return

    async def start(self, status: int, content_type: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
        self.status = status
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [(b"content-type", content_type), (b"x-request-id", self.id.encode()),
                                      *headers]})

    async def write(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        self.finished = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def respond(self, status: int, data: bytes, content_type: bytes = JSON,
                      headers: list[tuple[bytes, bytes]] = ()) -> None:
        await self.start(status, content_type, [(b"content-length", str(len(data)).encode()), *headers])
        await self.end(data)

    async def json(self, status: int, obj: Any, headers: list[tuple[bytes, bytes]] = ()) -> None:
        await self.respond(status, _dumps(obj), JSON, headers)

    async def error(self, exc: ApiError) -> None:
        headers = [(b"retry-after", str(exc.retry_after).encode())] if exc.retry_after else []
        headers += exc.headers
        if exc.close:  # so that a keep-alive client does not send its next request down a closing connection
            headers.append((b"connection", b"close"))
        await self.json(exc.status, exc.body(), headers)

    async def event(self, obj: Any) -> None:
        await self.write(b"data: " + _dumps(obj) + b"\n\n")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


# ---------------------------------------------------------------- response shapes
class _Chat:
    """chat.completion and chat.completion.chunk objects."""

    prefix, object_name = "chatcmpl-", "chat.completion"

    def __init__(self, model: str, token_piece: Callable[[int], bytes] | None = None,
                 tool_plan: tools.ToolPlan | None = None):
        self.id = self.prefix + secrets.token_hex(12)
        self.model = model
        self.created = int(time.time())
        self.token_piece = token_piece  # for logprobs: each token's text
        self.text_offset = 0  # completions' logprobs: where the next token's text starts
        self.tool_plan = tool_plan  # a chat offering tools: how its reply is read

    def logprobs(self, entries: list | None) -> dict | None:
        """OpenAI's chat logprobs object for these tokens' TokenLogprobs (None: none were asked for)."""
        if entries is None:
            return None

        def item(token: int, logprob: float) -> dict:
            piece = self.token_piece(token)
            return {"token": piece.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(piece)}

        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def _envelope(self, object_name: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": "skippy", "choices": choices, **extra}

    def whole(self, result: GenerationResult) -> dict:
        message, finish = {"role": "assistant", "content": result.text, "refusal": None}, result.finish_reason
        if self.tool_plan is not None:
            message, finish = tools.message(self.tool_plan, result)
        choice = {"index": 0, "message": message, "logprobs": self.logprobs(result.logprobs), "finish_reason": finish}
        return self._envelope(self.object_name, [choice], usage=usage(result))

    def chunk(self, delta: dict, finish_reason: str | None = None, logprobs: list | None = None, **extra) -> dict:
        return self._envelope("chat.completion.chunk",
                              [{"index": 0, "delta": delta, "logprobs": self.logprobs(logprobs),
                                "finish_reason": finish_reason}], **extra)

    def opening(self) -> list[dict]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def piece(self, text: str, logprobs: list | None = None) -> dict:
        return self.chunk({"content": text}, logprobs=logprobs)

    def closing(self, result: GenerationResult, logprobs: list | None = None) -> dict:
        return self.chunk({}, result.finish_reason, logprobs=logprobs)

    def usage_chunk(self, result: GenerationResult) -> dict:
        return self._envelope("chat.completion.chunk", [], usage=usage(result))


class _Completion(_Chat):
    """text_completion objects (streamed chunks have the same object name)."""

    prefix, object_name = "cmpl-", "text_completion"

    def logprobs(self, entries: list | None) -> dict | None:
        """The completions logprobs object (tokens, token_logprobs, top_logprobs, text_offset)."""
        if entries is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            piece = self.token_piece(e.token).decode("utf-8", "replace")
            out["tokens"].append(piece)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self.token_piece(t).decode("utf-8", "replace"): lp for t, lp in e.top})
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(piece)
        return out

    def whole(self, result: GenerationResult) -> dict:
        choice = {"index": 0, "text": result.text, "logprobs": self.logprobs(result.logprobs),
                  "finish_reason": result.finish_reason}
        return self._envelope(self.object_name, [choice], usage=usage(result))

    def _text_chunk(self, text: str, finish_reason: str | None, logprobs: list | None = None) -> dict:
        return self._envelope(self.object_name,
                              [{"index": 0, "text": text, "logprobs": self.logprobs(logprobs),
                                "finish_reason": finish_reason}])

    def opening(self) -> list[dict]:
        return []

    def piece(self, text: str, logprobs: list | None = None) -> dict:
        return self._text_chunk(text, None, logprobs)

    def closing(self, result: GenerationResult, logprobs: list | None = None) -> dict:
        return self._text_chunk("", result.finish_reason, logprobs)

    def usage_chunk(self, result: GenerationResult) -> dict:
        return self._envelope(self.object_name, [], usage=usage(result))


def usage(result: GenerationResult) -> dict:
    completion = len(result.tokens)
    # cached_tokens: prompt tokens no stage computed (every stage held them in its prefix cache); prefix_cache:
    # per stage, the prompt tokens it held rather than computed
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            "prefix_cache": result.prefix_cache,
            **({} if result.speculation is None else {"speculation": result.speculation})}


async def _run(off_loop: bool, fn: Callable, *args):
    """``fn(*args)``, in a worker thread if ``off_loop``."""
    return await trio.to_thread.run_sync(fn, *args) if off_loop else fn(*args)


# ---------------------------------------------------------------- the application
class OpenAIApp:
    """ASGI 3 application over a node's head (its engine; whether the node drains)."""

    def __init__(self, node: NodeView, *, model_id: str | None = None, metrics: Metrics | None = None,
                 access: Access | None = None):
        self.node = node
        self.access = access if access is not None else Access()
        self._model_id = model_id
        self.metrics = metrics if metrics is not None else Metrics(node)
        self.created = int(time.time())
        self.answering = 0  # generation requests whose response has not ended yet (a drain waits for them)
        self.routes: dict[tuple[str, str], Callable[[Exchange], Awaitable[None]]] = {
            ("GET", "/v1/models"): self.list_models,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/v1/completions"): self.completions,
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.metrics_text,
        }
        self.mounted: list = []  # more routes (skippyd.openai.console.Route), each with the access it needs

    # ------------------------------------------------------------ state
    @property
    def engine(self):
        return self.node.engine

    @property
    def model_id(self) -> str:
        return self._model_id or self.node.head.model_name

    def _draining(self) -> bool:
        pool = self.node.pool
        return self.node.draining or (pool is not None and pool.draining)

    @property
    def _vision(self) -> dict | None:
        head = self.node.head
        return head.vision if head is not None else None

    def _ready_engine(self):
        engine = self.engine
        if engine is None:
            raise ApiError(503, "the model is loading", code="loading", retry_after=RETRY_AFTER_S)
        if self._draining():
            raise ApiError(503, "the server is draining: no new generations", code="draining",
                           retry_after=RETRY_AFTER_S)
        return engine

    def _check_model(self, model: str) -> None:
        if model != self.model_id:
            raise ApiError(404, f"The model `{model}` does not exist (this server has `{self.model_id}`)",
                           param="model", code="model_not_found")

    # ------------------------------------------------------------ ASGI
    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(Exchange(scope, receive, send))

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def mount(self, routes) -> None:
        """Serve ``routes`` (each with method, path, a prefix when it ends with "/", handler, need and label)
        beside the API's."""
        self.mounted.extend(routes)

    def _need(self, ex: Exchange, endpoint: str) -> Need:
        if ex.path == "/v1" or ex.path.startswith("/v1/"):
            return Need.API
        if endpoint == "/metrics":
            return Need.METRICS
        return next((r.need for r in self.mounted if r.label == endpoint), Need.OPEN)

    def _mounted(self, ex: Exchange):
        """The mounted route of this path: the one naming it exactly, else the longest prefix that holds it."""
        path = ex.path
        exact = [r for r in self.mounted if r.path == path]
        prefixes = [r for r in self.mounted if r.path.endswith("/") and len(r.path) > 1 and path.startswith(r.path)]
        return next(iter(exact), None) or max(prefixes, key=lambda r: len(r.path), default=None)

    def _route(self, ex: Exchange) -> tuple[str, Callable[[Exchange], Awaitable[None]] | None]:
        path = ex.path.rstrip("/") or "/"
        handler = self.routes.get((ex.method, path))
        if handler is not None:
            return path, handler
        route = self._mounted(ex)
        if route is not None:
            return route.label, route.handler if ex.method == route.method else None
        if path.startswith("/v1/models/"):
            return "/v1/models/{model}", self.retrieve_model if ex.method == "GET" else None
        if any(p == path for _, p in self.routes):
            return path, None  # known path, wrong method
        return "other", None  # (a bounded set of endpoint labels for the metrics)

    async def _http(self, ex: Exchange) -> None:
        endpoint, handler = self._route(ex)
        started = time.perf_counter()
        counted = handler in (self.chat_completions, self.completions)
        self.answering += counted
        try:
            with span("http.request", request=ex.id, method=ex.method, endpoint=endpoint):
                self._check_access(ex, endpoint)
                if handler is None:
                    if endpoint == "other":
                        raise ApiError(404, f"no such endpoint: {ex.method} {ex.path}", code="not_found")
                    raise ApiError(405, f"{ex.method} is not allowed on {ex.path}", code="method_not_allowed")
                await handler(ex)
        except _ClientGone:
            pass
        except ApiError as exc:
            if ex.status is None and not ex.disconnected:
                await ex.error(exc)
        except Exception as exc:  # a bug must answer 500, not take the server down
            log.exception("openai: %s %s failed", ex.method, ex.path)
            if ex.status is None and not ex.disconnected:
                await ex.error(ApiError(500, f"internal error: {exc}", code="internal_error"))
        finally:
            self.answering -= counted
            if ex.disconnected and not ex.finished:
                status = 499
            else:
                status = ex.status or 500
            self.metrics.observe_request(endpoint, status, time.perf_counter() - started)

    def _check_access(self, ex: Exchange, endpoint: str) -> None:
        try:
            self.access.check(self._need(ex, endpoint), ex.header(b"authorization"))
        except Refused as exc:
            error = ApiError(exc.status, exc.message, code=exc.code)
            error.headers = [(b"www-authenticate", b"Bearer")] if exc.status == 401 else []
            raise error from None

    # ------------------------------------------------------------ endpoints
    def _model_object(self) -> dict:
        # what it takes: text, and images when the head has a projector (its type, an image's tokens)
        vision = self._vision
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "skippy",
                "input_modalities": ["text", "image"] if vision else ["text"],
                **({"vision": vision} if vision else {})}

    @property
    def body_limit(self) -> int:
        """A request body's largest size: for a head that takes images, two images of its largest (as base64), or
        more smaller ones, besides the rest of the request."""
        if not self._vision:
            return MAX_BODY_BYTES
        return MAX_BODY_BYTES + 2 * (4 * (self.node.config.runtime.image_max_mb << 20) // 3 + 4)

    async def list_models(self, ex: Exchange) -> None:
        data = [self._model_object()] if self.engine is not None else []
        await ex.json(200, {"object": "list", "data": data})

    async def retrieve_model(self, ex: Exchange) -> None:
        self._check_model(ex.path.rstrip("/")[len("/v1/models/"):])
        await ex.json(200, self._model_object())

    async def health(self, ex: Exchange) -> None:
        engine = self.engine
        if engine is None:
            await ex.json(503, {"status": "loading"})
        elif self._draining():
            await ex.json(503, {"status": "draining", "live_generations": len(engine.live)})
        else:
            await ex.json(200, {"status": "ok", "model": self.model_id, "live_generations": len(engine.live)})

    async def metrics_text(self, ex: Exchange) -> None:
        await self.metrics.refresh_caches()  # the remote stages' prefix caches (the collector cannot wait)
        await ex.respond(200, self.metrics.render(), METRICS_CONTENT_TYPE.encode())

    async def chat_completions(self, ex: Exchange) -> None:
        await self._complete(ex, schemas.ChatCompletionRequest, _Chat)

    async def completions(self, ex: Exchange) -> None:
        await self._complete(ex, schemas.CompletionRequest, _Completion)

    # ------------------------------------------------------------ generation
    async def _complete(self, ex: Exchange, body_type: type, shape_type: type[_Chat]) -> None:
        """Read the request, generate, and answer with the whole response or as a stream of events."""
        req, engine, greq, shape = await self._read(ex, body_type, shape_type)
        if not req.streaming:
            await ex.json(200, shape.whole(await self._generate(ex, engine, greq, None)))
            return
        stream = EventStream(ex, shape, include_usage=req.include_usage, logprobs=greq.sampling.logprobs is not None)
        try:
            result = await self._generate(ex, engine, greq, stream)
        except ApiError as exc:
            if not stream.started:
                raise  # nothing sent yet: an honest status code
            await stream.fail(exc)
            return
        await stream.close(result)

    async def _read(self, ex: Exchange, body_type: type, shape_type: type[_Chat]):
        """The request, checked, as a generation with its prompt tokenized, and the shape of its answer:
        anything wrong is a 400 naming the field (or a 404, a 503) before any stage is touched."""
        try:
            body = await ex.body(self.body_limit)
            # a large body (a long chat, images in base64) is parsed, its images' bytes decoded, in a worker
            # thread: the event loop goes on answering meanwhile
            off_loop = len(body) >= INLINE_BODY_BYTES
            req = await _run(off_loop, schemas.parse, body, body_type)
            self._check_model(req.model)
            engine = self._ready_engine()
            greq = await _run(off_loop, req.to_generation, engine.model.n_vocab, engine.context.n_ctx_seq)
            plan = None
            if isinstance(req, schemas.ChatCompletionRequest):  # its tools and tool history
                greq, plan = tools.prepare(req, greq, engine.model)
        except schemas.BadParameter as exc:
            raise ApiError(400, str(exc), param=exc.param, code=exc.code) from exc
        greq = await self._tokenized(engine, greq)
        shape = shape_type(self.model_id, engine.model.token_piece if greq.sampling.logprobs is not None else None,
                           plan)
        return req, engine, greq, shape

    async def _tokenized(self, engine, greq: GenerationRequest) -> GenerationRequest:
        """Tokenize (and check) the prompt here, its images decoded, so that one that cannot fit is a 400
        naming its field, before anything is sent."""
        param = "prompt" if greq.raw else "messages"
        try:
            if greq.images:
                return attrs.evolve(greq, prepared=await engine.prepare(greq))
            tokens = await engine.tokenize_prompt(greq)
        except LlamaError as exc:  # e.g. a model without a chat template
            raise ApiError(400, str(exc), code="invalid_value") from exc
        except PromptTooLong as exc:
            message = (str(exc) if greq.images else
                       f"This model's context holds {exc.n_ctx} tokens per request; the prompt has {exc.tokens}")
            raise ApiError(400, message, param=param, code="context_length_exceeded") from exc
        except ImageRefused as exc:
            raise ApiError.from_generation(exc) from exc
        except GenerationError as exc:
            raise ApiError(400, str(exc), param=param, code="invalid_value") from exc
        return attrs.evolve(greq, prompt_tokens=tuple(tokens.tolist()), origin="openai")

    async def _generate(self, ex: Exchange, engine, greq: GenerationRequest,
                        stream: EventStream | None) -> GenerationResult:
        """Run one generation (the engine admits it: its one queue, with its queue timeout); the client going
        away cancels it (and the engine frees the session). A stream's pieces are sent by a task of their own
        (see PieceRelay), all before this returns. One that did not end with its reply is an ApiError."""
        with span("openai.generation", request=ex.id) as s:
            outcome = None  # stays None when the client leaves first: its going cancels the generation
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_when_gone, ex, nursery.cancel_scope)
                relay = None
                if stream is not None:
                    relay = PieceRelay(stream.send, on_logprobs=stream.keep_logprobs)
                    nursery.start_soon(_relay_pieces, ex, relay, nursery.cancel_scope)
                try:
                    outcome = await _outcome(ex, engine, greq, relay)
                finally:
                    nursery.cancel_scope.cancel()
            if isinstance(outcome, Exception):  # raised here, outside the nursery: not wrapped in a group
                raise outcome
            if outcome is None:
                raise _ClientGone()
            s.set(engine_request=outcome.request_id, session=outcome.session_id, tokens=len(outcome.tokens),
                  finish_reason=outcome.finish_reason)
        self.metrics.record_generation(outcome, source="http")
        if outcome.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            why = outcome.error or "cancelled by an operator (sessions kill) or a shutdown"
            raise ApiError(503 if outcome.finish_reason == FinishReason.CANCELLED else 500,
                           f"the generation ended early ({outcome.finish_reason}): {why}",
                           code=str(outcome.finish_reason))
        return outcome


async def _outcome(ex: Exchange, engine, greq: GenerationRequest,
                   relay: PieceRelay | None) -> GenerationResult | Exception | None:
    """The generation's result or its failure (a GenerationError as its ApiError), once every piece of a
    stream is out; None if the client took none of them in time."""
    try:
        outcome = await engine.generate(greq, relay or DISCARD)
    except GenerationError as exc:
        outcome = ApiError.from_generation(exc)
        outcome.__cause__ = exc
    except Exception as exc:
        outcome = exc
    if relay is not None:
        try:
            await relay.finish()  # every piece is out before the closing event (or the error)
        except ClientStalled as exc:
            log.warning("openai: request %s: %s", ex.id, exc)
            return None
    return outcome


async def _cancel_when_gone(ex: Exchange, scope: trio.CancelScope) -> None:
    await ex.wait_disconnect()
    scope.cancel()


async def _relay_pieces(ex: Exchange, relay: PieceRelay, scope: trio.CancelScope) -> None:
    try:
        await relay.run()
    except Exception as exc:  # the client is gone: so is its generation
        log.info("openai: request %s: streaming failed (%s); cancelling it", ex.id, exc)
        scope.cancel()


class EventStream:
    """A streamed answer's server-sent events. The response starts with the first piece (so that what fails
    before a token exists is still an honest status code); a reply offering tools is sent as the deltas of
    its text and calls as they are read. With logprobs, each event carries those of the tokens not sent yet."""

    def __init__(self, ex: Exchange, shape: _Chat, *, include_usage: bool, logprobs: bool):
        self.ex, self.shape, self.include_usage = ex, shape, include_usage
        self.extra = {"usage": None} if include_usage else {}
        self.reply = tools.ReplyStream(shape.tool_plan) if shape.tool_plan is not None else None
        self.logprobs: list | None = [] if logprobs else None  # each token's, as the generation makes them
        self._logprobs_sent = 0

    @property
    def started(self) -> bool:
        return self.ex.status is not None

    def keep_logprobs(self, entry) -> None:
        if self.logprobs is not None:
            self.logprobs.append(entry)

    async def send(self, text: str, _pieces: int) -> None:
        """A piece of the reply's text (the relay's send)."""
        if self.reply is None:
            await self._event(self.shape.piece(text, self._unsent()))
            return
        for delta in self.reply.feed(text):
            await self._event(self.shape.chunk(delta))

    async def close(self, result: GenerationResult) -> None:
        """The last events: what the reply held back, its finish_reason, the usage if asked, [DONE]."""
        shape = self.shape
        if self.reply is None:
            await self._event(shape.closing(result, self._unsent() or None))
        else:
            rest, finish = self.reply.finish(result)
            for delta in rest:
                await self._event(shape.chunk(delta))
            await self._event(shape.chunk({}, finish, logprobs=self._unsent() or None))
        if self.include_usage:
            await self.ex.event(shape.usage_chunk(result))
        await self.ex.end(b"data: [DONE]\n\n")

    async def fail(self, exc: ApiError) -> None:
        """The generation failed after the stream started: an error event ends it."""
        await self.ex.event(exc.body())
        await self.ex.end()

    async def _event(self, chunk: dict) -> None:
        ex = self.ex
        if ex.status is None:
            await ex.start(200, b"text/event-stream", [(b"cache-control", b"no-cache")])
            for opening in self.shape.opening():
                await ex.event({**opening, **self.extra})
        await ex.event({**chunk, **self.extra})

    def _unsent(self) -> list | None:
        if self.logprobs is None:
            return None
        new, self._logprobs_sent = self.logprobs[self._logprobs_sent:], len(self.logprobs)
        return new
