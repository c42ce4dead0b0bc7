"""The JSON thread's work on a large request body (request_body.py sends it there): parse it and
validate it against its endpoint's model in short pieces, resting between them, so that the
event loop and the engine's step thread get the GIL back within about WORK_S whatever the body
holds.

Both steps are C code that holds the GIL from start to end unless it calls back into Python:

- json.loads calls a hook for every object and number (DutyCycle rests there), but builds
  strings, arrays and true/false/null literals with no call: request_body.py bounds them before
  parsing (max_request_json_strings: 100,000 of them, ~2 ms; json's Python scanner, resting at
  every value, was tried and let other streams wait longer: ~1 s of work instead of 20 ms a
  million).
- pydantic validates a whole body in one call. Here each list of models (chat messages, tools,
  one message's content parts) is validated item by item, and each long list or dict of plain
  values (token ids, lists of token id lists, logit_bias, stop strings, guided_choice) PIECE
  values at a time, resting between pieces; the first bad piece is the 400 (its errors located
  in the body, index included: a million bad ids are not a million errors). Each such field
  then stands in the body by its first item, so the final whole-body validation (and
  FastAPI's, which takes the model as it is) never walks it in one piece, and its whole
  validated value is put back on the model.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
import types
import typing
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

WORK_S, REST_S = 0.001, 0.001  # the JSON thread's duty cycle
PIECE = 2048  # plain values validated in one call (~0.05 ms of pydantic's time)
PIECE_ERRORS = 20  # a bad piece's errors reported (a list of a million bad ids is not a million errors)


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


def _bare(annotation: Any) -> Any:
    """The type under Annotated[...] (a union member's Tag, a field's constraints)."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def _tag(annotation: Any) -> str | None:
    if typing.get_origin(annotation) is not typing.Annotated:
        return None
    return next((m.tag for m in annotation.__metadata__ if isinstance(m, Tag)), None)


def _container_form(info: FieldInfo, value: Any) -> Any:
    """The list[X] or dict[K, V] that `value` (a list or dict) is validated as in the field
    described by `info`, as pydantic picks it (a callable discriminator's tag, else the one list
    or dict member of a union); None when there is no such one choice, or the field has
    constraints of its own (a length bound must see the whole value)."""
    discriminators = [m for m in info.metadata if isinstance(m, Discriminator)]
    if len(discriminators) != len(info.metadata):
        return None
    annotation = info.annotation
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = typing.get_args(annotation) if union else (annotation,)
    if discriminators:
        if not callable(discriminators[0].discriminator):
            return None
        tag = discriminators[0].discriminator(value)
        members = tuple(m for m in members if _tag(m) == tag)
    kind = list if isinstance(value, list) else dict
    found = [m for m in map(_bare, members) if typing.get_origin(m) is kind]
    return found[0] if len(found) == 1 else None


def _model_item(annotation: Any) -> type[BaseModel] | None:
    item = _bare(annotation)
    return item if isinstance(item, type) and issubclass(item, BaseModel) else None


@functools.lru_cache(maxsize=64)
def _adapter(form: Any, allow_inf_nan: bool) -> TypeAdapter:
    """A validator for one piece of a plain-value field (a pure cache: building one takes ~1 ms)."""
    return TypeAdapter(form, config=ConfigDict(allow_inf_nan=allow_inf_nan))


class BadPiece(Exception):
    """A piece of a large field did not validate: its errors, located in the whole body."""

    def __init__(self, errors: list[dict]) -> None:
        super().__init__(f"{len(errors)} validation errors")
        self.errors = errors


def _located(exc: ValidationError, loc: tuple, index_offset: int | None = None) -> BadPiece:
    """The errors of a piece (a list's slice starting at `index_offset`, a dict's items, a
    model item) as FastAPI reports a body's: located from the body down."""
    errors = []
    for err in exc.errors(include_url=False)[:PIECE_ERRORS]:
        inner = err.get("loc", ())
        if index_offset is not None and inner and isinstance(inner[0], int):
            inner = (inner[0] + index_offset, *inner[1:])
        errors.append({**err, "loc": (*loc, *inner)})
    return BadPiece(errors)


def _plain_pieces(form: Any, value: list | dict, allow_inf_nan: bool, duty: DutyCycle, loc: tuple) -> list | dict:
    """`value` validated as `form` (a list or dict of plain values) PIECE values at a time,
    resting between pieces; the first bad piece raises BadPiece."""
    adapter = _adapter(form, allow_inf_nan)
    if isinstance(value, dict):
        out: dict = {}
        items = iter(value.items())
        for _ in range(0, len(value), PIECE):
            duty.tick()
            try:
                out.update(adapter.validate_python(dict(itertools.islice(items, PIECE))))
            except ValidationError as exc:
                raise _located(exc, loc) from None
        return out
    nested = typing.get_origin(_bare(typing.get_args(form)[0])) in (list, dict)
    done: list = []
    start = 0
    while start < len(value):
        stop = start + PIECE
        if nested:  # (lists of token id lists: a piece is PIECE ids, not PIECE lists)
            stop, weight = start, 0
            while stop < len(value) and weight < PIECE:
                weight += 1 + (len(value[stop]) if isinstance(value[stop], (list, dict)) else 0)
                stop += 1
        duty.tick()
        try:
            done.extend(adapter.validate_python(value[start:stop]))
        except ValidationError as exc:
            raise _located(exc, loc, start) from None
        start = stop
    return done


def _model_items(item_model: type[BaseModel], items: list, duty: DutyCycle, loc: tuple) -> list:
    """A list of models validated item by item (each in pieces itself), resting between items."""
    done = []
    for i, item in enumerate(items):
        duty.tick()
        done.append(_validated(item_model, item, duty, (*loc, i)))
    return done


def _validated(model: type[BaseModel], data: Any, duty: DutyCycle, loc: tuple) -> Any:
    """model.model_validate(data) with its large fields in pieces (a bad one: BadPiece)."""
    short, whole = _in_pieces(model, data, duty, loc)
    try:
        value = model.model_validate(short)
    except ValidationError as exc:
        raise _located(exc, loc) from None
    return _put_back(value, whole)


def _in_pieces(model: type[BaseModel], data: Any, duty: DutyCycle, loc: tuple) -> tuple[Any, dict[str, Any]]:
    """(`data` with each list of models, and each list or dict of plain values longer than
    PIECE, validated here in pieces and replaced by its first item; {field: the whole validated
    value}). The stand-in keeps the form the field validates as and its place among the fields
    set; _put_back returns the whole value to the model the rest validates into, so the
    whole-body validation never walks a long field in one piece."""
    if not isinstance(data, dict):
        return data, {}
    short: dict | None = None
    whole: dict[str, Any] = {}
    allow_inf_nan = model.model_config.get("allow_inf_nan", True)
    for name, info in model.model_fields.items():
        key = info.alias or name
        value = data.get(key)
        if not isinstance(value, (list, dict)) or not value:
            continue
        form = _container_form(info, value)
        if form is None:
            continue
        item_model = _model_item(typing.get_args(form)[0]) if isinstance(value, list) else None
        if item_model is not None:
            done: list | dict = _model_items(item_model, value, duty, (*loc, key))
        elif len(value) > PIECE and not any(map(_model_item, typing.get_args(form))):
            done = _plain_pieces(form, value, allow_inf_nan, duty, (*loc, key))
        else:
            continue
        short = short if short is not None else dict(data)
        short[key] = done[:1] if isinstance(done, list) else dict(itertools.islice(done.items(), 1))
        whole[name] = done
    return (short if short is not None else data), whole


def _put_back(value: Any, whole: dict[str, Any]) -> Any:
    for name, done in whole.items():
        value.__dict__[name] = done  # (validated already: no assignment validation to run again)
    return value


def validate(field: Any, data: Any, duty: DutyCycle) -> tuple[Any, list]:
    """FastAPI's validation of a request body (`field`: the route's body field), in pieces:
    (the value, errors as FastAPI reports them)."""
    model = field.field_info.annotation
    whole: dict[str, Any] = {}
    if isinstance(model, type) and issubclass(model, BaseModel):
        try:
            data, whole = _in_pieces(model, data, duty, ("body",))
        except BadPiece as exc:
            return None, exc.errors
    duty.tick()
    value, errors = field.validate(data, {}, loc=("body",))
    return (_put_back(value, whole) if not errors else value), errors
