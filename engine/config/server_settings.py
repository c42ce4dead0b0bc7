"""ServerSettings: the HTTP server's settings (`kiln serve`); the engine's are EngineSettings
(engine/config/settings.py). Sources as for every setting (engine/config/settings_base.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from engine.config.settings_base import KilnSettingsBase
from engine.config.values import json_value, word_list


class ServerSettings(KilnSettingsBase):
    """HTTP server settings (`kiln serve`)."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="forbid", enable_decoding=False)

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0: any free port)")
    api_key: str | None = Field(
        None,
        description="clients must send Authorization: Bearer <key> on every route but /health, /ping and the "
        "chat page at /",
    )
    public_metrics: bool = Field(False, description="serve /metrics without the API key (scrapers that send none)")
    served_model_name: list[str] | None = Field(
        None,
        description="model names the API answers to; the first is reported (default: the model path as given, "
        "as vLLM does)",
    )
    warm_prefixes: Path | None = Field(None, description="file of prompt prefixes to prefill at start-up")
    request_timeout: float | None = Field(None, gt=0, description="seconds before a request is aborted")
    log_level: str = Field("info", description="kiln's log level while serving")
    serve_chat_page: bool = Field(
        True, description="serve kiln's chat page at / (--no-serve-chat-page: nothing at /, as vLLM)"
    )
    # Tool calling with tool_choice "auto": the model's own call format is parsed (vLLM's flags).
    enable_auto_tool_choice: bool = Field(False, description="let the model call tools on its own")
    tool_call_parser: (
        Literal[
            "hermes",
            "llama3_json",
            "llama4_json",
            "granite",
            "internlm",
            "mistral",
            "pythonic",
            "llama4_pythonic",
            "qwen3_coder",
            "qwen3_xml",
            "deepseek_v3",
            "deepseek_v31",
            "glm45",
            "kimi_k2",
            "openai",
        ]
        | None
    ) = Field(None, description="how tool calls are read from the model's text (its family's call format)")
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    allow_runtime_lora_updating: bool = Field(False, description="allow /v1/load_lora_adapter and unload")
    lora_adapter_roots: list[Path] | None = Field(
        None,
        description="directories /v1/load_lora_adapter may load adapters from (needed with "
        "allow_runtime_lora_updating)",
    )
    # Hardening (issue 12): request bodies, grammar compiles, shutdown.
    max_request_body_mb: float = Field(32.0, gt=0, description="larger request bodies get a 413, unread")
    grammar_compile_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a structured-output constraint whose compile takes more CPU time is a 400 "
        "(its wall time may run to 4 times this on a busy machine)",
    )
    grammar_compile_workers: int = Field(2, ge=1, description="processes compiling constraints (bounded pool)")
    grammar_compile_queue_per_client: int = Field(
        8, ge=1, description="constraints one client address may have waiting to compile; more get a 429"
    )
    grammar_cache_entries: int = Field(256, ge=1, description="compiled constraints kept (LRU)")
    grammar_cache_mb: float = Field(256.0, gt=0, description="bytes of compiled constraints kept (LRU)")
    # The Responses API's stored responses (`store`, `previous_response_id`): in memory, oldest dropped first.
    response_store_entries: int = Field(1000, ge=0, description="stored responses kept (0: none are stored)")
    response_store_mb: float = Field(64.0, gt=0, description="bytes of stored responses kept")
    response_store_max_age_s: float = Field(3600.0, gt=0, description="seconds a stored response is kept")
    shutdown_timeout: float = Field(
        30.0, ge=0, description="on SIGTERM/SIGINT: seconds in-flight requests get to finish before they are ended"
    )
    tokenizer_threads: int = Field(4, ge=1, description="threads that tokenise prompts and apply chat templates")
    # Hardening, second round (issue 27): every byte bounded before work, HTTP timeouts, slow readers.
    tokenizer_large_job_chars: int = Field(
        65536, ge=1, description="texts at least this long are tokenised on their own lane (short ones never wait)"
    )
    tokenizer_large_job_threads: int = Field(1, ge=1, description="threads of the lane for long texts")
    max_request_json_values: int = Field(
        1_000_000, ge=1, description="a request body with more JSON values (numbers, strings, ...) gets a 400, unparsed"
    )
    max_request_json_objects: int = Field(
        100_000,
        ge=1,
        description="a request body with more JSON objects gets a 400, unparsed (an object costs ~50 "
        "numbers to parse: the bound keeps one body's parse off other streams' latency)",
    )
    http_idle_timeout_s: float = Field(
        75.0,
        gt=0,
        description="a kept-alive connection with no request in progress closes after this (longer "
        "than clients' own keep-alive, so none reuses a connection as it closes)",
    )
    http_max_connections: int = Field(
        1000,
        ge=1,
        description="open connections at most: a new one beyond it closes the longest-idle kept-alive "
        "connection, or gets a 503 if none is idle (idle floods cannot hold the port)",
    )
    http_header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a new connection's request head, or one begun on a kept-alive connection, not "
        "complete this long after it opened / began gets a 408",
    )
    http_body_timeout_s: float = Field(30.0, gt=0, description="a request body that stalls this long gets a 408")
    http_body_deadline_s: float = Field(
        120.0, gt=0, description="a request body not complete this long after its head gets a 408 (however it trickles)"
    )
    stream_stall_timeout_s: float = Field(
        30.0,
        ge=0,
        description="a client that reads no output this long: its request is aborted, its connection closed (0: never)",
    )
    stream_pause_tokens: int = Field(
        256,
        ge=0,
        description="a stream with this many tokens its client has not read pauses its request (not "
        "scheduled, KV kept) until the client reads (0: never pause)",
    )
    http_send_buffer_kb: int = Field(
        256,
        ge=0,
        description="the kernel's send buffer per connection (bounds what a client that does not read "
        "holds; 0: the OS's autotuning, up to megabytes)",
    )
    retry_after_s: int = Field(1, ge=0, description="the Retry-After header of every 503 (overloaded, shutting down)")
    # Hardening, third round (issue 39).
    max_request_json_strings: int = Field(
        100_000,
        ge=1,
        description="a request body with more JSON string values, arrays and true/false/null literals (object "
        "keys not counted) gets a 400, unparsed (they are built with no pause: a million strings hold the "
        "interpreter ~20 ms)",
    )
    # Split chat answers into reasoning_content and content (vLLM's --reasoning-parser).
    reasoning_parser: (
        Literal["deepseek_r1", "qwen3", "deepseek_v3", "glm45", "step3", "hunyuan", "mistral", "granite", "gpt_oss"]
        | None
    ) = Field(None, description="split chat answers into reasoning_content and content")

    # --- vLLM-compatible server settings (issue 13) ---
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "info", description="uvicorn's log level"
    )
    disable_uvicorn_access_log: bool = Field(False, description="no access log line per HTTP request")
    enable_log_requests: bool = Field(
        False, description="log each API request's endpoint and body (prompt, sampling parameters)"
    )
    allowed_origins: list[str] | None = Field(
        None, description="CORS origins allowed (JSON list or words, e.g. '[\"*\"]'); default: no CORS headers"
    )
    root_path: str | None = Field(None, description="path prefix when served behind a path-based proxy")
    forwarded_allow_ips: list[str] | None = Field(
        None,
        description="proxies whose X-Forwarded-For / X-Forwarded-Proto are trusted (addresses or networks, "
        "'*' for any); default none: the client is the socket's peer",
    )
    ssl_keyfile: Path | None = Field(None, description="TLS private key (serve HTTPS)")
    ssl_certfile: Path | None = Field(None, description="TLS certificate (serve HTTPS)")
    # --- vLLM flags, second round (issue 44): the rest of CORS ---
    allow_credentials: bool = Field(False, description="CORS: allow credentials (cookies, Authorization)")
    allowed_methods: list[str] = Field(["*"], description="CORS: HTTP methods allowed (JSON list or words)")
    allowed_headers: list[str] = Field(["*"], description="CORS: request headers allowed (JSON list or words)")
    ssl_ca_certs: Path | None = Field(
        None, description="TLS: CA certificates that client certificates are checked against"
    )
    ssl_cert_reqs: int = Field(
        0,
        ge=0,
        le=2,
        description="TLS client certificates (with ssl_ca_certs): 0 not asked, 1 checked if sent, 2 required",
    )
    ssl_ciphers: str | None = Field(None, description="TLS: OpenSSL cipher list (default: Python's)")
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description='JSON of chat template variables for every request, e.g. {"enable_thinking": false} '
        "(a request's chat_template_kwargs win)",
    )

    @field_validator("default_chat_template_kwargs", mode="before")
    @classmethod
    def _parse_template_kwargs(cls, v: Any) -> Any:
        value = json_value(v, "default_chat_template_kwargs")
        if isinstance(value, dict):
            from engine.core.admission_rules import RESERVED_TEMPLATE_KWARGS  # (kiln sets these itself)

            if reserved := sorted(set(value) & RESERVED_TEMPLATE_KWARGS):
                raise ValueError(f"may not set {', '.join(reserved)}")
        return value

    @field_validator(
        "served_model_name",
        "allowed_origins",
        "forwarded_allow_ips",
        "lora_adapter_roots",
        "allowed_methods",
        "allowed_headers",
        mode="before",
    )
    @classmethod
    def _parse_lists(cls, v: Any) -> Any:
        return word_list(v)

    @model_validator(mode="after")
    def _check_combinations(self) -> "ServerSettings":
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: give both")
        if self.ssl_keyfile is None and (self.ssl_ca_certs or self.ssl_cert_reqs or self.ssl_ciphers):
            raise ValueError("ssl_ca_certs, ssl_cert_reqs and ssl_ciphers need ssl_keyfile and ssl_certfile (HTTPS)")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("ssl_cert_reqs needs ssl_ca_certs: the CAs client certificates are checked against")
        if self.allow_runtime_lora_updating and not self.lora_adapter_roots:
            raise ValueError(
                "allow_runtime_lora_updating needs lora_adapter_roots: the directories adapters may be "
                "loaded from (nothing else on the server's disk is reachable through the API)"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice needs tool_call_parser (the model family's call format, e.g. hermes)"
            )
        return self

    @property
    def model_names(self) -> list[str]:
        return list(self.served_model_name or [])

    @property
    def auto_tool_parser(self) -> str | None:
        return self.tool_call_parser if self.enable_auto_tool_choice else None
