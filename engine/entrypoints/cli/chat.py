"""`kiln chat`: an interactive conversation in the terminal, streamed as it is generated.

`kiln chat MODEL [engine flags]` runs the model in this process; `kiln chat --url URL` talks to a
running server's /v1/chat/completions instead. Either way the model's chat template renders the
conversation (here through the server's own chat_prompt_ids; there, by the server), the history
is sent with every turn, and Ctrl-C stops an answer where it is (the partial answer is kept; a
second Ctrl-C before it has stopped, or one at the prompt, quits: status 130 for the former; the
answer's request is aborted on the way out, here or by the server as the connection closes, so
no KV blocks stay held)."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine.config.process_env import client_api_key

HELP = "/exit (or Ctrl-D) quits, /reset starts over, /system TEXT sets the system prompt, Ctrl-C stops an answer"
STOPPED = " [stopped]"


class ChatError(RuntimeError):
    """A turn that failed (the server's error, a template that does not render): shown, not fatal."""


@dataclass
class Sampling:
    """The sampling options given on the command line (None: the model's or server's default)."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


class RemoteChat:
    """A running server's /v1/chat/completions, streamed (server-sent events)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600) -> None:
        import httpx

        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=timeout)
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        import httpx

        try:
            resp = self.http.get(f"{self.base}/models")
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {self.base}: {exc}") from exc
        if resp.status_code != 200:
            raise ChatError(f"{self.base}/models: {_error_text(resp.status_code, resp.text)}")
        return resp.json()["data"][0]["id"]

    def stream(self, messages: list[dict[str, str]], sampling: Sampling) -> Iterator[str]:
        import httpx

        try:
            yield from self._stream(messages, sampling)
        except httpx.HTTPError as exc:
            raise ChatError(f"{self.base}: {exc}") from exc

    def _stream(self, messages: list[dict[str, str]], sampling: Sampling) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, "stream": True, **sampling.given()}
        # Leaving the `with` (an answer stopped by Ctrl-C included) closes the connection: the
        # server aborts the request and frees its KV blocks.
        with self.http.stream("POST", f"{self.base}/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise ChatError(_error_text(resp.status_code, resp.read().decode("utf-8", "replace")))
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ChatError(chunk["error"].get("message", "the stream failed"))
                for choice in chunk.get("choices", []):
                    if text := (choice.get("delta") or {}).get("content"):
                        yield text

    def close(self) -> None:
        self.http.close()


class LocalChat:
    """The model in this process (an LLM's engine), stepped here, each step's text handed out."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.model = llm.settings.model
        self._turns = 0
        # The chat template is transformers' (behind kiln's fast tokenizer): loaded while the user types.
        load_template = getattr(llm.engine.tokenizer, "load_full_in_background", None)
        if load_template is not None:
            load_template()

    def stream(self, messages: list[dict[str, str]], sampling: Sampling) -> Iterator[str]:
        from engine.core.admission_rules.refusal import InvalidRequestError
        from engine.entrypoints.openai.admission import chat_prompt_ids

        engine = self.llm.engine
        params = self.llm.get_default_sampling_params().clone(**sampling.given())
        request_id = f"chat-{self._turns}"
        self._turns += 1
        try:
            ids = chat_prompt_ids(engine.tokenizer, messages)
            engine.submit(engine.admission.admit(ids, params, request_id, output_kind="delta"))
        except (InvalidRequestError, ValueError) as exc:
            raise ChatError(str(exc)) from exc
        finished = False
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id != request_id:
                        continue
                    if out.outputs and out.outputs[0].text:
                        yield out.outputs[0].text
                    finished = out.finished
        finally:
            if not finished:  # stopped (the caller closed the stream): free its blocks now
                engine.abort_request(request_id)

    def close(self) -> None:
        self.llm.close()


def repl(
    backend,
    sampling: Sampling,
    system: str | None = None,
    read: Callable[[str], str] = input,
    write: Callable[[str], Any] | None = None,
) -> None:
    """Read a message, stream the answer, keep both in the history; until /exit or end of input.
    read and write: input() and sys.stdout's write by default."""
    write = write or sys.stdout.write

    def start() -> list[dict[str, str]]:
        return [{"role": "system", "content": system}] if system else []

    messages = start()
    write(f"kiln chat with {backend.model}: {HELP}\n")
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit", "/bye"):
            return
        if command == "/reset":
            messages = start()
            continue
        if command == "/system" or command.startswith("/system "):
            system = command[len("/system") :].strip() or None
            messages = start() + [m for m in messages if m["role"] != "system"]
            continue
        if command.startswith("/") and " " not in command:
            write(f"unknown command {command}: {HELP}\n")
            continue
        messages.append({"role": "user", "content": line})
        answer: list[str] = []
        stream = backend.stream(messages, sampling)
        try:
            with _first_interrupt_stops() as stop:
                for piece in stream:
                    write(piece)
                    answer.append(piece)
                    _flush(write)
                    if stop.is_set():
                        write(STOPPED)
                        break
        except ChatError as exc:
            write(f"error: {exc}\n")
            messages.pop()  # the failed turn is not part of the conversation
            continue
        finally:
            stream.close()  # (a stopped answer's request is aborted here)
        write("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})


@contextlib.contextmanager
def _first_interrupt_stops():
    """While an answer streams, the first Ctrl-C sets the event (the answer stops at its next piece,
    between two engine steps, never inside one); a second raises KeyboardInterrupt as usual, maybe
    inside a step: the stream's own cleanup (LocalChat's abort, RemoteChat's closed connection)
    frees the request's blocks as the exception passes."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_interrupt(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def _flush(write) -> None:
    owner = getattr(write, "__self__", None)
    if owner is not None and hasattr(owner, "flush"):
        owner.flush()


def _error_text(status: int, body: str) -> str:
    try:
        return f"{status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{status}: {body[:300]}"


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model (no --url)")
    parser.add_argument("--url", help="a running kiln (or any OpenAI-compatible) server, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--api-key",
        default=client_api_key(),
        help="the server's API key, with --url (default: KILN_API_KEY or OPENAI_API_KEY)",
    )
    parser.add_argument("--served-model", help="the model to ask for, with --url (default: the server's first)")
    parser.add_argument("--system", help="the system prompt")
    parser.add_argument("--temperature", type=float, default=None, help="(default: the model's generation config)")
    parser.add_argument("--top-p", type=float, default=None, help="(default: the model's generation config)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default: up to the context)")


def run(args: argparse.Namespace, engine_settings: Callable[[], dict[str, Any]]) -> int:
    """`kiln chat` with parsed flags; engine_settings() gives the engine flags given (local mode)."""
    sampling = Sampling(args.temperature, args.top_p, args.max_tokens)
    try:
        if args.url:
            if args.model_tag is not None:
                raise ChatError("give MODEL or --url, not both (with --url, --served-model names the model)")
            backend: RemoteChat | LocalChat = RemoteChat(args.url, args.api_key, args.served_model)
        else:
            from engine.entrypoints.llm import LLM

            backend = LocalChat(LLM(**engine_settings()))
    except ChatError as exc:
        print(f"kiln chat: {exc}", file=sys.stderr)
        return 2
    try:
        repl(backend, sampling, args.system)
    except KeyboardInterrupt:  # (a second Ctrl-C during an answer)
        print(file=sys.stderr)
        return 130
    finally:
        backend.close()
    return 0
