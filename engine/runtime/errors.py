"""The errors the engine loop raises to its callers (the server maps them to 503s)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The step loop has stopped (crashed or shut down); no request can be served."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit (max_waiting_requests)."""
