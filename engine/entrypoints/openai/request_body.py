"""Reading a JSON request body with every size bounded before the work it would cause.

The event loop serves every stream, so nothing that grows with a body may run long there. A
request body (already capped in bytes by GateMiddleware) is, in order:

1. counted: more than max_request_json_values JSON values, max_request_json_objects objects,
   or max_request_json_strings string values and arrays, is a 400 before parsing (a C-speed
   scan; parsing 10 million token ids, or 240,000 tool definitions, would hold the interpreter
   for seconds: objects cost ~50x a number to build; strings and arrays are built with no point
   for the JSON thread to rest at, a million ~20 ms in one piece);
2. parsed (json.loads: bounded by 1.); a body of OFF_LOOP_BYTES or more is parsed, and steps
   3-5 run, on the server's JSON thread, in pieces that rest the thread regularly
   (json_thread.py), so it hands the GIL to the loop and the step thread within about a
   millisecond: a plain json.loads holds it from start to end (a 99,000-object body: ~0.35 s
   with a server-sized heap), and so does pydantic's validation of a whole body;
3. checked for lone surrogates, only when the bytes can hold one (a byte search);
4. shaped: a token-id prompt with no room in max_model_len, more prompts than a request may hold,
   more chat messages than max_model_len, more allowed/stop token ids than the vocabulary, more
   stop strings (or characters in them) than a request may hold, tools whose definitions are
   too large or too deep: a 400 from len() and bounded walks alone, before any per-token work
   (pydantic's validation included), by the rules of engine/core/admission_rules/;
5. validated against the endpoint's model: a large body on the JSON thread (json_thread.py:
   item by item), then by FastAPI, which takes the validated model as it is; a small one by
   FastAPI, as usual.

`BoundedJSONRoute` does 1-5 for every JSON endpoint of the API.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from engine.core import admission_rules as rules
from engine.core.admission_rules import InvalidRequestError
from engine.entrypoints.openai import json_thread
from engine.runtime.engine_info import EngineInfo


def _may_hold_surrogates(body: bytes) -> bool:
    """What can decode to a lone surrogate: a \\uD800-\\uDFFF escape, or its raw (invalid UTF-8)
    bytes, which start with 0xED (byte searches: a regex would be ten times slower)."""
    if b"\xed" in body:
        return True
    return b"\\" in body and (b"\\ud" in body or b"\\uD" in body)  # (a backslash first: a byte's search)


def max_prompts(info: EngineInfo) -> int:
    """The most prompts (times samples) one request may hold."""
    return max(info.max_num_seqs, 1) * 16


_PLAIN = frozenset({int, float, bool, type(None)})


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path of the first string (or key) holding a lone UTF-16 surrogate, which no tokenizer
    or UTF-8 encoder accepts; None if there is none. (A bad key is shown escaped, not raw.)"""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and lone_surrogate_path(k) is not None:
                return f"{path}[{ascii(k)}]" if path else f"[{ascii(k)}]"
            found = lone_surrogate_path(v, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        if _PLAIN.issuperset(map(type, value)):  # (token ids: no per-item call)
            return None
        for i, v in enumerate(value):
            found = lone_surrogate_path(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


# Kept by the counter: what delimits strings and values, and the first letter of each literal
# (true, false, null), all three mapped to one byte: a literal is then one `t`, and a string
# holding only letters of those collapses to `"t"`, which cancels like an empty one.
_KEPT = b'"{[,:'
_LITERAL_LETTERS = b"tfn"
_TABLE = bytes.maketrans(_LITERAL_LETTERS, b"ttt")
_UNCOUNTED = bytes(sorted(set(range(256)) - set(_KEPT) - set(_LITERAL_LETTERS)))
_RUNS = (b"t" * 64, b"t" * 8, b"tt")


class JSONValueCounter:
    """Counts, chunk by chunk as a body arrives, the separators of a JSON text outside its
    strings: every array element and object member but the first of each follows a comma and
    every container opens with a bracket, so the count bounds the values from above (within one
    per container). Only C-speed bytes operations per chunk; no parsing."""

    def __init__(self) -> None:
        self.count = 0
        self.objects = 0  # of those, objects (`{`): the costly values to parse
        self._quotes = 0
        self._keys = 0  # (a key's closing quote is followed by a colon)
        self._arrays = 0
        self._literals = 0
        self._in_string = False
        self._escaped = False  # the previous chunk ended inside a string on an unpaired backslash

    @property
    def unrested(self) -> int:
        """String values (object keys not counted), arrays and true/false/null literals: what
        json's C parser builds with no Python call, so with no point for the JSON thread to rest
        at (json_thread.py): a million strings hold it ~20 ms, a million literals ~10 ms."""
        return self._quotes // 2 - self._keys + self._arrays + self._literals

    def feed(self, chunk: bytes) -> int:
        if self._escaped:
            chunk, self._escaped = chunk[1:], False
        if b"\\" in chunk:  # escapes matter inside strings only, where JSON allows them
            chunk = chunk.replace(b"\\\\", b"")
            if chunk.endswith(b"\\"):
                chunk, self._escaped = chunk[:-1], True
            chunk = chunk.replace(b'\\"', b"")
        # Only quotes and what is counted matter; two adjacent quotes cancel (the characters
        # around them keep their side of every string): a body of many short strings leaves
        # few parts to split, not one Python object per string. Outside strings a literal's
        # letter stands between separators, so a `"t"` is always a string's content.
        chunk = chunk.translate(_TABLE, _UNCOUNTED)
        self._quotes += chunk.count(b'"')
        for run in _RUNS:  # (long runs first: a text's letters collapse in a few passes)
            while run in chunk:
                chunk = chunk.replace(run, b"t")
        parts = chunk.replace(b'"t"', b"").replace(b'""', b"").split(b'"')
        outside = b"".join(parts[1 if self._in_string else 0 :: 2])
        if len(parts) % 2 == 0:
            self._in_string = not self._in_string
        objects, arrays = outside.count(b"{"), outside.count(b"[")
        self.objects += objects
        self._arrays += arrays
        self._literals += outside.count(b"t")
        self._keys += outside.count(b":")
        self.count += outside.count(b",") + arrays + objects
        return self.count


def check_prompt_shape(info: EngineInfo, value: Any, param: str, truncated: bool) -> None:
    """A prompt field (text, texts, token ids, lists of token ids): counts from len() alone."""
    if not isinstance(value, list) or not value:
        return
    if isinstance(value[0], int):  # one prompt of token ids
        if not truncated:
            rules.prompt_length(len(value), None, info.max_model_len, param)
        return
    rules.prompt_count(len(value), max_prompts(info), param)
    if not truncated:
        for i, p in enumerate(value):
            if isinstance(p, list) and p:  # (an empty one is admission's to refuse, with the rest)
                rules.prompt_length(len(p), None, info.max_model_len, f"{param}[{i}]")


def check_shape(info: EngineInfo, data: Any, tick: Callable[[], None] | None = None) -> None:
    """Step 4 of the module docstring, on the parsed body (`tick`: a point to rest at, on the
    JSON thread)."""
    if not isinstance(data, dict):
        return
    truncated = data.get("truncate_prompt_tokens") is not None
    for field in ("prompt", "input"):
        if field in data:
            check_prompt_shape(info, data[field], field, truncated)
    messages = data.get("messages")
    if isinstance(messages, list):
        rules.message_count(len(messages), info.max_model_len)
        parts = [m.get("content") for m in messages if isinstance(m, dict)]
        rules.content_part_count(sum(len(p) for p in parts if isinstance(p, list)), info.max_model_len)
    for field in ("allowed_token_ids", "stop_token_ids"):
        ids = data.get(field)
        if isinstance(ids, list):
            rules.token_id_count(len(ids), info.vocab_size, field)
    if isinstance(data.get("tools"), list):
        rules.tool_count(len(data["tools"]))
        rules.tool_definition_size(data["tools"], tick)
    if isinstance(data.get("logit_bias"), dict):
        rules.logit_bias_count(len(data["logit_bias"]), info.vocab_size)
    for field in ("stop", "stop_sequences"):  # (stop_sequences: the Messages API's)
        stops = data.get(field)
        if isinstance(stops, list):
            rules.stop_string_count(stops, field)


async def read_body(
    request: Request, max_values: int, max_objects: int | None = None, max_strings: int | None = None
) -> tuple[bytearray, bool]:
    """(the body, whether it may hold a lone surrogate), both found as it arrives (step 1 of
    the module docstring). Past `max_values` JSON values, `max_objects` objects or `max_strings`
    string values and arrays the rest is read and dropped (the body limit bounds it), so the
    client reads the 400 on a healthy connection. The body grows in place (no join of the
    pieces at the end)."""
    counter = JSONValueCounter()
    body: bytearray | None = bytearray()
    surrogates, tail = False, b""
    async for chunk in request.stream():
        if body is not None:
            body += chunk
            surrogates = surrogates or _may_hold_surrogates(tail + chunk[:2]) or _may_hold_surrogates(chunk)
            tail = chunk[-2:]
            if (
                counter.feed(chunk) > max_values
                or (max_objects is not None and counter.objects > max_objects)
                or (max_strings is not None and counter.unrested > max_strings)
            ):
                body = None
    if body is None:
        if counter.count > max_values:
            raise InvalidRequestError(
                f"the request body holds more than max_request_json_values={max_values} JSON values"
            )
        if max_objects is not None and counter.objects > max_objects:
            raise InvalidRequestError(
                f"the request body holds more than max_request_json_objects={max_objects} JSON objects"
            )
        raise InvalidRequestError(
            f"the request body holds more than max_request_json_strings={max_strings} JSON strings, arrays and "
            "true/false/null literals"
        )
    return body, surrogates


OFF_LOOP_BYTES = 64 << 10  # (parsing this much takes ~1 ms: below it, a thread hop would cost more)


def parse_body(
    body: bytes | bytearray,
    info: EngineInfo,
    may_hold_surrogates: bool = True,
    yielding: bool = False,
    body_field: Any = None,
) -> Any:
    """Steps 2-4 of the module docstring; a malformed body raises json.JSONDecodeError.
    `yielding`: in resting pieces (on the JSON thread: see step 2),
    and then validated against `body_field` (the route's, when it has one body model: step 5;
    RequestValidationError as FastAPI raises it), the validated model returned."""
    duty = json_thread.DutyCycle() if yielding else None
    data = json_thread.loads(body, duty) if duty is not None else json.loads(body)
    if may_hold_surrogates:
        path = lone_surrogate_path(data)
        if path is not None:
            raise InvalidRequestError(f"{path}: the text is not valid Unicode (it holds a lone UTF-16 surrogate)", path)
    check_shape(info, data, duty.tick if duty is not None else None)
    if duty is not None and body_field is not None:
        value, errors = json_thread.validate(body_field, data, duty)
        if errors:
            raise RequestValidationError(errors, body=data)
        return value
    return data


def _is_json(content_type: str | None) -> bool:
    """What FastAPI parses as JSON: no content type, application/json or application/*+json."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class _ParsedRequest(Request):
    """A request whose JSON body kiln has read and parsed already (FastAPI reads it from here)."""

    def __init__(self, request: Request, body: bytes | bytearray, data: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._kiln_body, self._kiln_data = body, data

    async def body(self) -> bytes:
        return self._kiln_body

    async def json(self) -> Any:
        return self._kiln_data


class BoundedJSONRoute(APIRoute):
    """An API route whose JSON body is read with parse_body's bounds (the server's state is
    the app's `state.kiln`)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        # One body model, not embedded: a large body is validated on the JSON thread too.
        one_model = len(self.dependant.body_params) == 1 and not getattr(self, "_embed_body_fields", True)
        body_field = self.body_field if one_model else None

        async def bounded(request: Request):
            if not _is_json(request.headers.get("content-type")):
                return await handler(request)  # (FastAPI refuses it without parsing)
            state = request.app.state.kiln
            settings = state.settings
            body, surrogates = await read_body(
                request,
                settings.max_request_json_values,
                settings.max_request_json_objects,
                settings.max_request_json_strings,
            )
            if not body:
                return await handler(_ParsedRequest(request, body, None))
            try:
                if len(body) >= OFF_LOOP_BYTES:
                    data = await state.parse_off_loop(parse_body, body, state.info, surrogates, True, body_field)
                else:
                    data = parse_body(body, state.info, surrogates)
            except json.JSONDecodeError as exc:  # (as FastAPI reports it: errors.py names the field)
                raise RequestValidationError(
                    [
                        {
                            "type": "json_invalid",
                            "loc": ("body", exc.pos),
                            "msg": "JSON decode error",
                            "input": {},
                            "ctx": {"error": exc.msg},
                        }
                    ],
                    body=exc.doc,
                ) from exc
            except UnicodeDecodeError as exc:
                raise InvalidRequestError(
                    f"the request body is not valid JSON: it is not UTF-8 ({exc.reason} at byte {exc.start})", None
                ) from exc
            except RecursionError as exc:
                raise InvalidRequestError(
                    "the request body is not valid JSON here: it is nested too deeply", None
                ) from exc
            except InvalidRequestError:
                raise
            except ValueError as exc:  # (after its subclasses above): an integer of over 4,300 digits
                raise InvalidRequestError(
                    "the request body is not valid JSON here: a number in it has too many digits", None
                ) from exc
            return await handler(_ParsedRequest(request, body, data))

        return bounded
