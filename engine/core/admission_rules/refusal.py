"""A refusal (InvalidRequestError) and the row table the params' rules are written as."""

from __future__ import annotations

from typing import Any, Callable


class InvalidRequestError(ValueError):
    """A request that can never be served as given (bad parameters, too long)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


Row = tuple[str, Callable[[Any], bool], Callable[[Any], str]]  # (param, holds, message)


def _check(rows: tuple[Row, ...], value: Any) -> None:
    for param, holds, message in rows:
        if not holds(value):
            raise InvalidRequestError(message(value), param)
