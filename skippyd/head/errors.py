"""How a generation fails, as its callers (the control plane, the OpenAI app) see it."""

from __future__ import annotations

from skippyd.wire.messages import ErrorCode, ErrorReply


class GenerationError(Exception):
    """A generation failed; `retryable` says whether trying again later may work."""

    def __init__(self, message: str, *, retryable: bool = False, status: int = 500, stage_failure: bool = False,
                 slots_held: bool = False):
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.stage_failure = stage_failure  # a stage died, hung or was cut off (not the request's fault)
        # a stage had no free slot: it still holds sessions of lanes the head gave up (a fault it has not
        # noticed yet), since the head opens no more lanes than stage 1 has slots
        self.slots_held = slots_held


class PromptTooLong(GenerationError):
    """The prompt leaves no room in a session's context (`tokens` against `n_ctx`)."""

    def __init__(self, message: str, *, tokens: int = 0, n_ctx: int = 0):
        super().__init__(message, status=400)
        self.tokens = tokens
        self.n_ctx = n_ctx


class ImageRefused(GenerationError):
    """An image the generation cannot take (status 400, or 413 for one over the size or pixel limit); `source`
    names it as the request did (``messages[0].content[1]``, ``images[0]``), `code` says why in a word."""

    def __init__(self, message: str, *, source: str | None = None, status: int = 400, code: str = "invalid_image"):
        super().__init__(message, status=status)
        self.source = source
        self.code = code


class QueueTimeout(GenerationError):
    """No place for the generation (a head slot, then a lane) within the queue timeout."""

    def __init__(self, message: str):
        super().__init__(message, retryable=True, status=503)


class Draining(GenerationError):
    """The daemon is draining: it takes no new generation (those waiting for a place included)."""

    def __init__(self, message: str):
        super().__init__(message, retryable=True, status=503)


# stage errors worth retrying shortly: a full or draining stage, or one further down that died or hung
_RETRYABLE = (ErrorCode.NO_CAPACITY, ErrorCode.SHUTTING_DOWN, ErrorCode.DOWNSTREAM_FAILED)
# ... of which a stage further down failed (died, hung, cut off)
_STAGE_FAILED = (ErrorCode.DOWNSTREAM_FAILED,)


def stage_error(reply: ErrorReply) -> GenerationError:
    """A stage's Error reply as the generation's failure."""
    return GenerationError(f"stage error ({reply.code.name.lower()}): {reply.message}",
                           retryable=reply.code in _RETRYABLE,
                           status=400 if reply.code == ErrorCode.CONTEXT_FULL else 502,
                           stage_failure=reply.code in _STAGE_FAILED,
                           slots_held=reply.code == ErrorCode.NO_CAPACITY)


def pipeline_failed(why: object) -> GenerationError:
    """A stage died, hung or was cut off while the generation depended on it: worth a retry (or a replay)."""
    return GenerationError(f"pipeline failed: {why}", retryable=True, status=502, stage_failure=True)
