"""A stage's place in the pipeline and its resources: what the handlers of a connection work with.

:class:`StageCore` is everything a message handler may touch: the stage's
index and whether it is the final one, the next stage, the model, context,
scheduler and session table, the token-return link, how a session is
released, whether the stage drains, and the stage's counters. The listener
(``StageServer``) builds one, fills in the model, context and scheduler once
they exist, and hands it to every upstream connection; nothing here knows of
the listener, its admission or its set of connections, so a test can give a
connection's handlers a small fake core instead.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from skippyd.runtime.llama import Context, Model
from skippyd.stage.downstream import DownstreamLink
from skippyd.stage.link_choice import WirePolicy
from skippyd.stage.prefix_cache import PrefixCache, record_from
from skippyd.stage.scheduler import Scheduler
from skippyd.stage.sessions import SessionTable, StageSession
from skippyd.stage.token_return import TokenReturnLink
from skippyd.topology import StageSpec
from skippyd.wire.messages import Hello, WireFormat


@attrs.define
class StageCounters:
    """What a stage counts (the status snapshot reports them)."""

    refused_upstreams: int = 0  # upstream connections this stage refused at the handshake (any reason)
    handshaking: int = 0  # connections in their handshake now
    dropped_handshakes: int = 0  # connections closed unheard because max_handshakes were in progress
    # decode steps with DIRECT_RETURN: sent to the final stage (no ack owed), answered by the final stage on the
    # token-return connection only, and taken by a middle stage without a reply on its lane
    returns_only: dict[str, int] = attrs.field(factory=lambda: {"forwarded": 0, "answered": 0, "unacked": 0})
    windows_dropped: int = 0  # the final stage: chained verify windows dropped, unsampled (a draft before failed)
    # prefix cache lookups asked of this stage: by a RestorePrefix (a trip of its own through the stages), and
    # by the restore block of a prompt's first prefill chunk
    restores: dict[str, int] = attrs.field(factory=lambda: {"queries": 0, "with_prefill": 0})


class StageCore:
    """One stage's place (index, final or not, next stage) and resources (model, context, scheduler, sessions,
    token-return link), shared by every upstream connection of the stage.

    ``model``, ``context`` and ``scheduler`` are None until the stage has loaded them. ``config`` is the
    stage's StageConfig (its timeouts and limits). ``wrap(stream, nursery)`` is what a stage link made here
    sends through (the stream itself, unless links are conditioned)."""

    def __init__(self, index: int, n_stages: int, hello: Hello, config, *, next_stage: StageSpec | None,
                 sessions: SessionTable, token_return: TokenReturnLink | None = None,
                 wrap: Callable[[trio.SocketStream, trio.Nursery | None], trio.abc.SendStream] | None = None,
                 frame_min_rate: float | None = None, prefix_cache: PrefixCache | None = None):
        self.index = index
        self.n_stages = n_stages
        self.is_final = index == n_stages - 1
        self.next_is_final = index == n_stages - 2
        self.next_stage = next_stage
        self.hello = hello
        self.config = config
        self.model: Model | None = None
        self.context: Context | None = None
        self.scheduler: Scheduler | None = None
        self.sessions = sessions
        self.token_return = token_return
        self.wrap = wrap
        # the least rate (bytes/s) at which a frame, once started, must keep arriving
        self.frame_min_rate = config.frame_min_rate if frame_min_rate is None else frame_min_rate
        self.draining = False  # new sessions are refused (SHUTTING_DOWN); running ones go on
        self.counters = StageCounters()
        # the KV of this stage's layers for prompts it has computed (none: budget 0)
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0, stage_index=index)
        # how its links to the next stage choose their activations' encoding (the server times the compute)
        self.wire_policy = WirePolicy(config.activation_wire, hello.n_embd)

    async def release(self, session: StageSession) -> None:
        """Keep the session's KV in the prefix cache (if it wants it) and clear its KV sequence, then free its
        slot and sampler. Idempotent."""
        if self.sessions.get(session.conn_id, session.session_id) is not session:
            return
        seq = session.seq
        self.scheduler.forget(seq)
        # shielded: a slot must never be freed with its KV sequence still full
        with trio.CancelScope(shield=True):
            try:
                cache = self.prefix_cache
                # while draining too: a clean stop writes what the cache holds to its disk tier
                if cache.enabled and (cache.disk_on or not self.draining):
                    await record_from(cache, self.scheduler, self.context, seq, session.held_keys(), clear=True,
                                      rows=None if self.is_final else session.rows)
                else:
                    await self.scheduler.run_kv(lambda: self.context.kv_clear_seq(seq))
            finally:
                self.sessions.forget(session)

    async def open_downstream(self, nursery: trio.Nursery, *, timed: bool = True) -> DownstreamLink:
        """Dial the next stage and handshake (its tasks run in ``nursery``). ``timed``: the link may be timed
        to choose its activations' encoding (runtime.activation_wire "auto"); not for an upstream that did
        not time its own (a connection for a query, which carries no activations). Raises DownstreamError."""
        cfg = self.config
        nxt = self.next_stage
        # dialed inside an upstream's handshake: leave the upstream time to hear why, if we fail
        timeout = min(cfg.connect_timeout_s, 0.8 * cfg.handshake_timeout_s)
        hello = self.hello if timed else attrs.evolve(self.hello, wire_formats=self.hello.wire_formats
                                                      & ~WireFormat.TIMED)
        return await DownstreamLink.connect(nxt.host, nxt.port, hello, connect_timeout=timeout,
                                            credit_limit=cfg.credit_limit, reply_timeout=cfg.reply_timeout_s,
                                            write_timeout=cfg.write_timeout_s, wrap=self.wrap, nursery=nursery,
                                            policy=self.wire_policy)

    def no_direct_return(self) -> str:
        """Why this stage cannot return predictions straight to the head (while it cannot)."""
        link = self.token_return
        if link is not None:
            return f"no connection to the head at {link.address}: {link.last_error or 'retrying later'}"
        if self.n_stages < 3:
            return "the pipeline has fewer than three stages"
        return "turned off on this stage (runtime.direct_return = false)"
