"""The head's one decode loop, and the reply it makes.

Every step is a verify window: the current token and the drafts the
generation's :class:`~skippyd.head.speculation.Drafts` propose (none: a
plain step). The step's answer (the drafts the final stage accepted, then
the next token) joins the reply first; unless the reply ends within it, the
next step goes out for its last token at once, and the answer's text is
made and handed on while the other stages compute. The same rules end a
reply whatever its steps were: an end-of-generation token, a stop string,
``max_tokens``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from skippyd.head.errors import GenerationError
from skippyd.head.generation_lane import GenerationLane
from skippyd.head.live import LiveGeneration
from skippyd.head.sink import GenerationSink
from skippyd.head.speculation import Drafts
from skippyd.head.states import FinishReason
from skippyd.head.step_clock import StepClock
from skippyd.head.text_output import TextOutput
from skippyd.runtime.llama import TokenLogprobs


class Reply:
    """A generation's reply as it is made: its tokens (and their logprobs), its text, how it ended."""

    def __init__(self, token_piece: Callable[[int], bytes], is_eog: Callable[[int], bool], stops: Sequence[str],
                 sink: GenerationSink, *, max_tokens: int, ignore_eos: bool, logprobs: bool):
        self.tokens: list[int] = []
        # each token's logprobs (a generation that asked for them), in order; the sink gets each too
        self.logprobs: list[TokenLogprobs] | None = [] if logprobs else None
        self.text = TextOutput(token_piece, stops, sink.piece)
        self.sink = sink
        self.max_tokens = max_tokens
        # None: end-of-generation tokens are generated like any other (ignore_eos)
        self.is_eog = None if ignore_eos else is_eog
        self.finish_reason: FinishReason | None = None
        self.ttft_ms = 0.0

    def keep_logprobs(self, token: int, got: TokenLogprobs | None) -> None:
        """The logprobs of ``token``, just added: ``got``, the prediction's."""
        if got is None or got.token != token:
            got = TokenLogprobs(token, math.nan)  # not reported: never expected, kept in step
        self.logprobs.append(got)
        self.sink.logprobs(got)

    def stopped_at(self, i: int) -> None:
        """A stop string ends the reply with its token ``i`` (whose text completed it)."""
        del self.tokens[i + 1:]
        if self.logprobs is not None:
            del self.logprobs[i + 1:]
        self.finish_reason = FinishReason.STOP

    def end(self, reason: FinishReason) -> None:
        """The reply ended without a stop string: its held-back text goes out."""
        self.text.finish()
        self.finish_reason = reason


class _Step:
    """A step in flight: what the lane's ``begin`` returned, its tokens (the current one, then its drafts)
    and, once a draft of a step ahead of it failed, void."""

    __slots__ = ("sent", "tokens", "void")

    def __init__(self, sent: object, tokens: list[int]):
        self.sent, self.tokens, self.void = sent, tokens, False


class Decoder:
    """Runs a generation's decode loop on its lane, from the first token to the reply's end.

    Over a lane whose round trip is long against a window's compute (``lane.window_depth`` > 1), windows
    go out behind the one in flight, drafted as if it were accepted in full (its next token guessed too);
    the answers come back in order, and a window behind a rejected draft is void: the final stage drops
    it unsampled, the others trim it with the next step's position, and the loop reads its empty answer
    and drafts on from the answer that came. The tokens are the same either way."""

    def __init__(self, reply: Reply, live: LiveGeneration, clock: StepClock, drafts: Drafts, started: float):
        self.reply, self.live, self.clock, self.drafts = reply, live, clock, drafts
        self.started = started  # perf_counter: the request came in (the time to first token counts from it)
        self.in_flight: deque[_Step] = deque()  # oldest first; void ones at the front, if any

    async def run(self, lane: GenerationLane, token: int, context: Sequence[int]) -> None:
        """From ``token`` (predicted, not yet in the reply) until the reply ends; ``context``: the prompt and
        the reply so far (again after a replay), what drafts are taken from."""
        reply, live, clock, drafts = self.reply, self.live, self.clock, self.drafts
        tokens, text, is_eog, logprobs = reply.tokens, reply.text, reply.is_eog, reply.logprobs
        max_tokens = reply.max_tokens
        in_flight = self.in_flight
        in_flight.clear()
        drafts.begin([*context, token])
        answer = [token]
        clock.restart()
        while True:
            now = clock.tick()
            if live.first_token_at is None:  # (with last_token_at, the decode rate: see LiveGeneration)
                live.first_token_at = now
                reply.ttft_ms = live.ttft_ms = (now - self.started) * 1e3
            # the answer joins the reply up to the first token that ends it (its text is handed on below)
            since, end = len(tokens), None
            for t in answer:
                if is_eog is not None and is_eog(t):
                    end = FinishReason.STOP  # end-of-generation is not part of the reply
                    break
                tokens.append(t)
                if logprobs is not None:
                    reply.keep_logprobs(t, lane.logprobs)
                if len(tokens) >= max_tokens:
                    end = FinishReason.LENGTH
                    break
            if len(tokens) > since:
                live.generated = len(tokens)
                live.last_token_at = now
            if end is None:
                # the next step goes down the pipeline first (it is the critical path); this answer's text is
                # made and handed on while the other stages compute. A stop string found below leaves that
                # step in flight: the lane's end collects its reply before it stops the session.
                await self._send(lane, tokens[-1], max_tokens - len(tokens))
            for i in range(since, len(tokens)):
                if text.push(tokens[i]):  # a stop string: the reply ends with this token
                    reply.stopped_at(i)
                    live.generated = len(tokens)
                    return
            if end is not None:
                reply.end(end)
                return
            answer = await self._answer(lane)

    async def _send(self, lane: GenerationLane, token: int, room: int) -> None:
        """Keep the steps in flight: the step for ``token`` if none is (``room``: tokens the reply may still
        take), then windows behind it while they pay, up to the lane's depth."""
        in_flight, drafts = self.in_flight, self.drafts
        if not in_flight or in_flight[-1].void:  # nothing live in flight (void steps only sit ahead of live ones)
            draft = drafts.drafts(room - 1)  # (room for the step's next token)
            in_flight.append(_Step(await lane.begin(token, draft), [token, *draft]))
            if not draft:
                return  # a plain step: drafts do not pay now, nor would a window behind it
        live = [s for s in in_flight if not s.void]
        if len(live) == 1 and len(live[0].tokens) == 1:
            return  # a chained window of one token: nothing drafted to go behind it
        depth = lane.window_depth
        while len(live) < depth:
            ahead = [t for s in live for t in s.tokens][1:]  # past the current token
            window = list(drafts.chained(ahead, room - len(ahead) - 2))
            if not window:
                return
            step = _Step(await lane.begin(window[0], window[1:], chained=True), window)
            in_flight.append(step)
            live.append(step)

    async def _answer(self, lane: GenerationLane) -> list[int]:
        """The next answer: the oldest live step's (the void ones ahead of it are read first, each an empty
        answer). A rejected draft, or a next token other than the guess, voids the windows behind it."""
        in_flight, drafts = self.in_flight, self.drafts
        while in_flight[0].void:
            if await lane.finish(in_flight.popleft().sent):
                raise GenerationError("the final stage computed a verify window that a rejected draft made void",
                                      status=502)
        step = in_flight.popleft()
        answer = await lane.finish(step.sent)
        if not answer:
            raise GenerationError("the final stage dropped a verify window whose drafts were all accepted",
                                  status=502)
        drafts.done(step.tokens[1:], answer)
        if in_flight and (len(answer) < len(step.tokens) or answer[-1] != in_flight[0].tokens[0]):
            for behind in in_flight:
                behind.void = True
            drafts.dropped(len(in_flight))
            await lane.abandon()
        return answer
