"""The websocket control channel (trio-websocket), served by every skippyd.

Generation, ``sessions`` and ``lanes`` need the head; ``status`` (and
``sessions list`` of a stage's own sessions) work on any daemon. ``cache``
reports the prefix cache of every stage of the pipeline on the head, of the
daemon's own stages elsewhere.

Every connection must present the token (``Authorization: Bearer …``),
compared in constant time. Each request runs as a task in the connection's
nursery, so a streaming generation and a ``sessions kill`` can share one
connection; when the connection closes (Ctrl-C in skippyctl), the nursery
is cancelled and so is every generation it started, through the engine's
normal cleanup path.

Every message to a client must be out within ``control.message_timeout``
(10 s by default): a client that stops reading (its socket full, its host
gone) is dropped, and with it every generation it started, rather than
holding them, and the text queued for it, for as long as its TCP
connection lingers. A task per connection keeps that deadline (no cancel
scope per message).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import logging
from pathlib import Path

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, serve_websocket

from skippyd.config import DEFAULTS
from skippyd.control import messages as m
from skippyd.control.token import default_token_file, load_or_create_token
from skippyd.head.cache_admin import CacheReportError, clear_local
from skippyd.head.engine import GenerationError, GenerationRequest, ImageInput
from skippyd.head.piece_relay import ClientStalled, PieceRelay
from skippyd.listening import explain_bind_errors
from skippyd.ports import DeploymentPort, NodeView
from skippyd.sampling import InvalidSampling

log = logging.getLogger("skippyd.control")

KILL_WAIT_S = 5.0  # `sessions kill` answers once the session is released (or after this long)
MESSAGE_TIMEOUT_S = DEFAULTS.control.message_timeout
MESSAGE_BYTES = 1 << 20  # a request's largest JSON text, besides its images


def max_message_bytes(node: NodeView) -> int:
    """A head that takes images (or a daemon that waits for a deployment, which may make it one) takes a
    request carrying two images of the largest size it accepts (base64: 4 bytes for 3), or more smaller ones,
    besides its text; any other daemon a request's text alone. Only a client that presented the control token
    can send one."""
    head = node.head
    waiting = head is None and not node.stages
    if not (waiting or (head is not None and head.vision)):
        return MESSAGE_BYTES
    return MESSAGE_BYTES + 2 * (4 * (node.config.runtime.image_max_mb << 20) // 3 + 4)


@attrs.define(eq=False)
class _Connection:
    """A client's connection: called with a message, sends it; its requests' tasks run in ``nursery``."""

    ws: object
    nursery: trio.Nursery
    timeout: float = MESSAGE_TIMEOUT_S
    sending: int = 0  # messages being sent (or waiting for the stream) now
    since: float = 0.0  # trio time the oldest of them began, or the last one finished
    dropped: bool = False

    async def __call__(self, msg) -> None:
        # no lock of ours: trio-websocket frames the whole message before it takes its own FIFO stream
        # lock, so the messages of concurrent requests never interleave
        if not self.sending:
            self.since = trio.current_time()
        self.sending += 1
        try:
            await self.ws.send_message(m.dump(msg))
        finally:
            self.sending -= 1
            self.since = trio.current_time()  # progress: the next message in line gets a full deadline

    async def keep_deadline(self) -> None:
        """Drop the connection once a message has been on its way for ``timeout`` s."""
        while True:
            due = self.since + self.timeout
            if self.sending and trio.current_time() >= due:
                break
            await trio.sleep(max(due - trio.current_time(), 0.0) if self.sending else self.timeout / 4)
        self.dropped = True
        log.warning("control: client %s took no message for %g s: dropping it (and cancelling its generations)",
                    _remote(self.ws), self.timeout)
        stream = getattr(self.ws, "_stream", None)  # its socket: a close handshake would wait on the client too
        if stream is not None:
            await trio.aclose_forcefully(stream)
        self.nursery.cancel_scope.cancel()


def _remote(ws) -> str:
    try:
        remote = ws.remote
        return f"{remote.address}:{remote.port}"
    except Exception:  # the socket is gone already
        return "?"


class ControlServer:
    def __init__(self, node: NodeView, host: str, port: int, *, token_file: Path | None = None,
                 message_timeout: float | None = None):
        self.node = node
        # the daemon's setting (control.message_timeout) unless told
        self.message_timeout = node.config.control.message_timeout if message_timeout is None else message_timeout
        self.host, self.port = host, port
        self.token_file = token_file or default_token_file()
        self.token = load_or_create_token(self.token_file)
        self.answering = 0  # generation requests whose last message is not sent yet (a drain waits for them)
        self._open: set = set()  # the accepted websockets (told why when the daemon stops)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            with explain_bind_errors("control channel", self.host, self.port,
                                     "--control HOST:PORT (or --no-control)"):
                server = await nursery.start(functools.partial(
                    serve_websocket, self._handle, self.host, self.port, None,
                    max_message_size=max_message_bytes(self.node)))
            self.port = server.port
            log.info("control channel on ws://%s:%d (token in %s)", self.host, self.port, self.token_file)
            task_status.started(self)

    def _authorized(self, request: WebSocketRequest) -> bool:
        header = dict(request.headers).get(b"authorization", b"").decode("latin-1")
        presented = header[7:] if header.lower().startswith("bearer ") else ""
        # digests of equal length: the comparison's time reveals neither the token nor its length
        return hmac.compare_digest(hashlib.sha256(presented.encode()).digest(),
                                   hashlib.sha256(self.token.encode()).digest())

    async def _handle(self, request: WebSocketRequest) -> None:
        # a client that goes before its answer (a refusal, or the handshake's end) is no error of the daemon's
        try:
            if not self._authorized(request):
                await request.reject(401, body=b"missing or wrong control token")
                return
            ws = await request.accept()
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        self._open.add(ws)
        try:
            async with trio.open_nursery() as nursery:
                send = _Connection(ws, nursery, self.message_timeout)
                nursery.start_soon(send.keep_deadline)
                while True:
                    text = await ws.get_message()
                    try:
                        req = m.parse_request(text if isinstance(text, str) else text.decode("utf-8", "replace"))
                    except m.BadRequest as exc:
                        await send(m.Error(exc.request_id, str(exc)))
                        continue
                    nursery.start_soon(self._serve_request, req, send)
        except* ConnectionClosed:
            pass  # the client went away: its generations were cancelled with the nursery
        except* Exception as group:  # a bug must not take the daemon down
            log.error("control: connection handler failed", exc_info=group)
        finally:
            self._open.discard(ws)

    async def close_all(self, reason: str, timeout: float = 1.0) -> None:
        """Close every client's connection with 1001 (going away) and `reason`, rather than let the daemon's
        exit drop them without a word."""
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                for ws in list(self._open):
                    nursery.start_soon(ws.aclose, 1001, reason)

    async def _serve_request(self, req, send) -> None:
        counted = isinstance(req, m.Generate)
        self.answering += counted
        try:
            handler = getattr(self, f"on_{m._snake(type(req))}")
            await handler(req, send)
        except ConnectionClosed:
            raise
        except GenerationError as exc:
            code = "unavailable" if exc.retryable else ("bad_request" if exc.status in (400, 413) else "failed")
            await send(m.Error(req.id, str(exc), code=code, retryable=exc.retryable))
        except _NotFound as exc:
            await send(m.Error(req.id, str(exc), code="not_found"))
        except _NotHead as exc:
            await send(m.Error(req.id, str(exc), code="bad_request"))
        except CacheReportError as exc:
            await send(m.Error(req.id, str(exc), code="unavailable", retryable=True))
        except m.RequestFailed as exc:
            await send(m.Error(req.id, str(exc), code=exc.code, retryable=exc.retryable))
        except Exception as exc:  # a bug must not take the connection down
            log.exception("control: %s failed", type(req).__name__)
            await send(m.Error(req.id, f"internal error: {exc}", code="failed"))
        finally:
            self.answering -= counted

    # ---------------------------------------------------------------- operations
    @property
    def engine(self):
        engine = self.node.engine
        if engine is None:
            raise _NotHead("this daemon runs no head (stage 0): send generation requests to the head")
        return engine

    @property
    def pool(self):
        self.engine  # noqa: B018 - raises on a daemon without a head
        return self.node.pool

    async def on_generate(self, req: m.Generate, send) -> None:
        if self.node.draining:
            raise GenerationError("the daemon is draining (shutting down): no new generations", retryable=True,
                                  status=503)
        try:
            sampling = req.sampling()
        except InvalidSampling as exc:
            raise GenerationError(f"sampling parameters: {exc}", status=400) from exc
        greq = GenerationRequest(
            prompt=req.prompt, system=req.system, messages=tuple(req.messages), raw=req.raw,
            max_tokens=req.max_tokens, sampling=sampling, stop=tuple(req.stop), speculate=req.speculate,
            ignore_eos=req.ignore_eos, images=_images(req.images))

        if req.stream:
            result = await self._generate_streamed(greq, req.id, send)
        else:
            result = await self.engine.generate(greq)
        self.node.metrics.record_generation(result, source="control")
        await send(m.Result(req.id, result.to_json()))

    async def _generate_streamed(self, greq: GenerationRequest, request_id: str, send: _Connection):
        """Generate, the pieces sent by a task of the connection's (the generation never waits for the
        client); every piece is out before this returns or raises."""
        relay = PieceRelay(lambda text, pieces: send(m.Piece(request_id, text, pieces)))
        send.nursery.start_soon(relay.run)  # a failed send (the client gone) ends the connection, as any
        try:
            return await self.engine.generate(greq, relay)
        finally:
            try:
                await relay.finish()
            except ClientStalled as exc:  # its socket is full: nothing more can reach it
                log.warning("control: closing a connection: %s", exc)
                send.nursery.cancel_scope.cancel()

    async def on_sessions_list(self, req: m.SessionsList, send) -> None:
        if self.node.engine is None:
            await send(m.Data(req.id, self._stage_sessions()))
            return
        await send(m.Data(req.id, [self._describe(g) for g in self.engine.live.values()]))

    def _describe(self, live) -> dict:
        """A head session, with its sequence on every stage this daemon also runs (--stage all)."""
        d = live.describe()
        for stage in self.node.stages:
            held = next((s for s in stage.sessions.snapshot()["sessions"] if s["session_id"] == live.session_id),
                        None)
            d["stages"][str(stage.index)] = {"seq": held["seq"], "position": held["position"]} if held else None
        return d

    def _stage_sessions(self) -> list[dict]:
        """Sessions held by this daemon's stages (a daemon without the head)."""
        out = []
        for stage in sorted(self.node.stages, key=lambda s: s.index):
            for s in stage.sessions.snapshot()["sessions"]:
                out.append({"session_id": s["session_id"], "request_id": s["request_id"], "state": s["state"],
                            "prompt_tokens": None, "generated": s["generated"], "position": s["position"],
                            "age_s": s["age_s"], "lane": None, "decode_tokens_per_s": None,
                            "stages": {str(stage.index): {"seq": s["seq"], "position": s["position"]}}})
        return out

    def _live(self, session_id: int):
        live = self.engine.live.get(session_id)
        if live is None:
            raise _NotFound(f"unknown session {session_id} (finished, or never started here)")
        return live

    async def on_session_show(self, req: m.SessionShow, send) -> None:
        if self.node.engine is None:
            found = [s for s in self._stage_sessions() if s["session_id"] == req.session_id]
            if not found:
                raise _NotFound(f"unknown session {req.session_id} (finished, or never started here)")
            await send(m.Data(req.id, found[0]))
            return
        await send(m.Data(req.id, self._describe(self._live(req.session_id))))

    async def on_session_kill(self, req: m.SessionKill, send) -> None:
        """Cancel the generation (its normal cleanup runs on every stage).

        The answer comes at once, before the generation's own (cancelled) result;
        with ``wait`` only once the session is released everywhere (or KILL_WAIT_S).
        """
        self._live(req.session_id)
        self.engine.kill(req.session_id, "killed by an operator (skippyctl sessions kill)")
        if req.wait:
            with trio.move_on_after(KILL_WAIT_S):
                while req.session_id in self.engine.live:
                    await trio.sleep(0.01)
        released = req.session_id not in self.engine.live
        log.info("killed session %d%s", req.session_id, "" if released else " (still cleaning up)")
        await send(m.Data(req.id, {"killed": req.session_id, "released": released}))

    def _lanes(self) -> dict:
        pool = self.pool
        if pool is None:
            return {"draining": self.node.draining, "downstream": None, "lanes": []}
        return {"draining": pool.draining, "downstream": pool.address, "capacity": pool.capacity,
                "lanes": pool.describe(), "last_error": pool.last_error}

    async def on_lanes_list(self, req: m.LanesList, send) -> None:
        await send(m.Data(req.id, self._lanes()))

    async def on_lanes_drain(self, req: m.LanesDrain, send) -> None:
        if self.pool is not None:
            await self.pool.drain("the head's lanes are drained (skippyctl lanes drain): no new generations "
                                  "until `skippyctl lanes undrain`")
        await send(m.Data(req.id, self._lanes()))

    async def on_lanes_undrain(self, req: m.LanesUndrain, send) -> None:
        if self.pool is not None:
            self.pool.undrain()
        await send(m.Data(req.id, self._lanes()))

    async def _cache_stats(self, clear: bool = False, disk: bool = False) -> list:
        """Every stage's CacheStats: the whole pipeline's through the head, else this daemon's own stages."""
        head = self.node.head
        if head is not None:
            return await head.cache_report(clear=clear, disk=disk)
        out = []
        for stage in sorted(self.node.stages, key=lambda s: s.index):
            if clear:
                clear_local(stage.core.prefix_cache, stage.index, disk)
            out.append(stage.core.prefix_cache.stats())
        return out

    async def on_cache_show(self, req: m.CacheShow, send) -> None:
        await send(m.Data(req.id, [describe_cache(s) for s in await self._cache_stats()]))

    async def on_cache_clear(self, req: m.CacheClear, send) -> None:
        """Empty every stage's prefix cache; each stage's line says what it held just before (``cleared``
        entries, ``cleared_bytes``) and what it holds after."""
        before = {s.stage_index: s for s in await self._cache_stats()}
        try:
            after = await self._cache_stats(clear=True, disk=req.disk)
        except CacheReportError as exc:
            cleared = ", ".join(str(s.stage_index) for s in exc.partial) or "none"
            raise CacheReportError(exc.stage, f"{exc} (stages cleared before it: {cleared})", exc.partial) from exc
        out = []
        for s in after:
            held = before.get(s.stage_index)
            out.append({**describe_cache(s), "cleared": held.entries if held else None,
                        "cleared_bytes": held.bytes_held if held else None,
                        "cleared_disk": (held.disk_entries if held else None) if req.disk else 0,
                        "cleared_disk_bytes": (held.disk_bytes if held else None) if req.disk else 0})
        await send(m.Data(req.id, out))

    async def on_status(self, req: m.Status, send) -> None:
        await send(m.Data(req.id, await self.node.status()))

    # ---------------------------------------------------------------- deployment (skippyd.deploy)
    @property
    def assignment(self) -> DeploymentPort:
        assignment = self.node.deployment
        if assignment is None:
            raise m.RequestFailed("this daemon takes no deployments (it runs without a slices directory)")
        return assignment

    async def on_host(self, req: m.Host, send) -> None:
        await send(m.Data(req.id, await trio.to_thread.run_sync(self.assignment.host)))

    async def on_slice_offer(self, req: m.SliceOffer, send) -> None:
        slices = self.assignment.slices
        offer = await trio.to_thread.run_sync(slices.offer, req.sha256, req.size)
        await send(m.Data(req.id, offer.as_dict()))

    async def on_slice_chunk(self, req: m.SliceChunk, send) -> None:
        try:
            data = base64.b64decode(req.data, validate=True)
        except binascii.Error as exc:
            raise m.RequestFailed(f"slice_chunk data is not base64: {exc}") from None
        received = await trio.to_thread.run_sync(self.assignment.slices.write, req.sha256, req.offset, data)
        await send(m.Data(req.id, {"received": received}))

    async def on_slice_commit(self, req: m.SliceCommit, send) -> None:
        await trio.to_thread.run_sync(self.assignment.slices.commit, req.sha256, req.size)
        await send(m.Data(req.id, {"held": True}))

    async def on_calibrate(self, req: m.Calibrate, send) -> None:
        await send(m.Data(req.id, await self.assignment.calibrate(req.sha256, req.fresh)))

    async def on_stage_assign(self, req: m.StageAssign, send) -> None:
        if self.node.draining:
            raise m.RequestFailed("the daemon is draining (shutting down)", "unavailable", retryable=True)
        await send(m.Data(req.id, await self.assignment.assign(req.topology, req.stage)))

    async def on_stage_release(self, req: m.StageRelease, send) -> None:
        await send(m.Data(req.id, {"released": await self.assignment.release()}))

    async def on_supervise(self, req: m.Supervise, send) -> None:
        await send(m.Data(req.id, await self.assignment.supervise(req)))

    async def on_add_host(self, req: m.AddHost, send) -> None:
        await send(m.Data(req.id, self.assignment.add_host(req.name, req.url)))

    async def on_receipts(self, req: m.Receipts, send) -> None:
        kept = list(self.engine.receipts)[-max(0, req.limit):]
        await send(m.Data(req.id, [attrs.asdict(r) for r in kept]))


def _images(encoded: list[str]) -> tuple[ImageInput, ...]:
    """A Generate's images, from base64 (GenerationError 400 naming one that is not)."""
    out = []
    for i, text in enumerate(encoded):
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise GenerationError(f"images[{i}]: not base64 ({exc})", status=400) from None
        out.append(ImageInput(data, f"images[{i}]"))
    return tuple(out)


def describe_cache(stats) -> dict:
    """One stage's prefix cache as the control channel answers it (a CacheStats)."""
    return {"stage": stats.stage_index, "entries": stats.entries, "tokens": stats.tokens_held,
            "bytes": stats.bytes_held, "budget_bytes": stats.budget_bytes, "lookups": stats.lookups,
            "hits": stats.hits, "hit_rate": stats.hit_rate, "restored_tokens": stats.restored_tokens,
            "recorded_tokens": stats.recorded_tokens, "evictions": stats.evictions,
            "memory_hits": stats.hits - stats.disk_hits,
            "disk": {"on": stats.disk_on, "entries": stats.disk_entries, "tokens": stats.disk_tokens,
                     "bytes": stats.disk_bytes, "budget_bytes": stats.disk_budget_bytes, "hits": stats.disk_hits,
                     "writes": stats.disk_writes}}


class _NotFound(LookupError):
    pass


class _NotHead(Exception):
    pass
