"""The JSON thread's work on a large request body (request_body.py sends it there): parse it and
validate it against its endpoint's model in short pieces, resting between them, so that the
event loop and the engine's step thread get the GIL back within about WORK_S whatever the body
holds.

Both steps are C code that holds the GIL from start to end unless it calls back into Python:

- json.loads calls a hook for every object and number (DutyCycle rests there), but builds
  strings, arrays and literals with no call: request_body.py bounds them before parsing
  (max_request_json_strings: 100,000 strings, ~2 ms; json's Python scanner, resting at every
  value, was tried and let other streams wait longer: ~1 s of work instead of 20 ms a million).
- pydantic validates a whole body in one call. Lists of models (chat messages, tools, content
  parts) are validated item by item here, resting between items; the finished items are model
  instances, which the final whole-body validation (and FastAPI's, after it) takes as they are.
"""

from __future__ import annotations

import json
import time
import types
import typing
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

WORK_S, REST_S = 0.001, 0.001  # the JSON thread's duty cycle


class DutyCycle:
    """tick() at every point the GIL may pass: after each WORK_S of work it sleeps REST_S.
    Passing at the interpreter's switch interval alone (5 ms) is not enough: the step thread
    gives the GIL up around every torch op and waited up to 5 ms to get it back each time (a
    convoy); now it waits at most WORK_S, and runs freely while this thread rests."""

    def __init__(self) -> None:
        self.rest_at = time.perf_counter() + WORK_S

    def tick(self) -> None:
        if time.perf_counter() >= self.rest_at:
            time.sleep(REST_S)
            self.rest_at = time.perf_counter() + WORK_S


def _hooks(duty: DutyCycle) -> dict[str, Callable]:
    """json's hooks for objects and numbers, each a point to rest at (building what json builds)."""

    def object_pairs(pairs: list) -> dict:
        duty.tick()
        return dict(pairs)

    def integer(text: str) -> int:
        duty.tick()
        return int(text)

    def real(text: str) -> float:
        duty.tick()
        return float(text)

    return {"object_pairs_hook": object_pairs, "parse_int": integer, "parse_float": real}


def loads(body: bytes | bytearray, duty: DutyCycle) -> Any:
    """json.loads(body), resting at every object and number."""
    return json.loads(body, **_hooks(duty))


def _model_list_item(annotation: Any) -> type[BaseModel] | None:
    """X for a field annotated list[X] or list[X] | None with X a model; else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        lists = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(lists) != 1:
            return None
        annotation = lists[0]
    if typing.get_origin(annotation) is not list:
        return None
    (item,) = typing.get_args(annotation) or (None,)
    return item if isinstance(item, type) and issubclass(item, BaseModel) else None


def _in_pieces(model: type[BaseModel], data: Any, duty: DutyCycle) -> Any:
    """`data` with the items of its lists of models validated one at a time (recursively); an
    item that does not validate stays as it came, for the whole-body validation to report with
    its full path."""
    if not isinstance(data, dict):
        return data
    out = None
    for name, info in model.model_fields.items():
        key = info.alias or name
        items = data.get(key)
        item_model = _model_list_item(info.annotation)
        if item_model is None or not isinstance(items, list) or len(items) < 2:
            continue
        done = []
        for item in items:
            duty.tick()
            try:
                done.append(item_model.model_validate(_in_pieces(item_model, item, duty)))
            except ValidationError:
                done.append(item)
        out = out if out is not None else dict(data)
        out[key] = done
    return out if out is not None else data


def validate(field: Any, data: Any, duty: DutyCycle) -> tuple[Any, list]:
    """FastAPI's validation of a request body (`field`: the route's body field), in pieces:
    (the value, errors as FastAPI reports them)."""
    model = field.field_info.annotation
    if isinstance(model, type) and issubclass(model, BaseModel):
        data = _in_pieces(model, data, duty)
    duty.tick()
    return field.validate(data, {}, loc=("body",))
