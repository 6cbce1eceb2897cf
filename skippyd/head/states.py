"""A generation's state while it runs, and how it ended: each value is the string status, receipts and
the APIs show."""

from __future__ import annotations

import enum


class GenerationState(enum.StrEnum):
    QUEUED = "queued"  # admitted to the engine, waiting for a place (or a lane)
    ENCODE = "encode"  # the head's projector encoding one of the prompt's images (then prefill goes on)
    PREFILL = "prefill"  # the prompt (again, on a replay) going through the stages
    DECODE = "decode"
    RESUMING = "resuming"  # a stage failed under it: waiting for the pipeline to replay on (see resume.py)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens (or the context's room)
    CANCELLED = "cancelled"  # killed, the client gone, a shutdown
    ERROR = "error"
