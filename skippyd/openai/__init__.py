"""The head's OpenAI-compatible HTTP API (``skippyd --openai HOST:PORT``) and the daemon's Prometheus metrics.

``app``      the ASGI application (routes, errors, streaming, disconnects)
``schemas``  request bodies: attrs classes and a strict cattrs converter
``metrics``  the Prometheus registry of one daemon
``server``   hypercorn's trio worker serving the app
"""

from __future__ import annotations

__all__ = ["Metrics", "OpenAIApp", "OpenAIServer"]


def __getattr__(name: str):
    # lazy: importing skippyd.openai.metrics must not pull in hypercorn
    if name == "OpenAIServer":
        from skippyd.openai.server import OpenAIServer

        return OpenAIServer
    if name == "OpenAIApp":
        from skippyd.openai.app import OpenAIApp

        return OpenAIApp
    if name == "Metrics":
        from skippyd.openai.metrics import Metrics

        return Metrics
    raise AttributeError(name)
