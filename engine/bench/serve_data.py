"""What `kiln bench serve` sends: its configuration, the prompts (random token ids from the server's
vocabulary, or a ShareGPT file) and the arrival times (Poisson, or gamma with burstiness)."""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

import httpx

_WORDS = (
    "the quick brown fox jumps over lazy dog kiln oven clay pottery brick model token batch block page cache "
    "memory attention value key step request stream server engine graph kernel hello world paris france "
    "number text answer question assistant user code data fast slow small large"
).split()


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class BenchConfig:
    url: str  # the server's base URL, without /v1
    model: str | None
    num_prompts: int
    request_rate: float
    max_concurrency: int | None
    input_len: int
    output_len: int
    seed: int
    burstiness: float = 1.0
    backend: str = "openai"
    endpoint: str = "/v1/completions"
    dataset_name: str = "random"
    dataset_path: str | None = None
    range_ratio: float = 0.0
    ignore_eos: bool = False
    temperature: float = 0.0
    # Sent only when set (vLLM's client's --top-p/--top-k/--min-p): the server's defaults otherwise.
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    sharegpt_output_len: int | None = None


def arrival_gaps(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds to wait before each request: gamma(burstiness) gaps with mean 1/rate (Poisson at 1)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


class ServerTokenizer:
    """The server's /tokenize and /detokenize (kiln's and vLLM's bodies, else llama-server's:
    {"content": ...}); words when it has none. The same vocabulary then gives every server the
    same token-id prompts."""

    def __init__(self, http: httpx.AsyncClient, cfg: BenchConfig, headers: dict[str, str]) -> None:
        self.http, self.cfg, self.headers = http, cfg, headers
        self.available = True

    async def encode(self, text: str) -> list[int] | None:
        if self.available:
            try:
                for body in ({"prompt": text, "add_special_tokens": False}, {"content": text, "add_special": False}):
                    resp = await self.http.post(f"{self.cfg.url}/tokenize", headers=self.headers, json=body)
                    if resp.status_code == 200 and resp.json().get("tokens"):  # (an unread key: no tokens)
                        return resp.json()["tokens"]
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            self.available = False
        return None

    async def decode(self, ids: list[int]) -> str | None:
        try:
            resp = await self.http.post(f"{self.cfg.url}/detokenize", json={"tokens": ids}, headers=self.headers)
            if resp.status_code == 200:
                body = resp.json()
                return body["prompt"] if "prompt" in body else body["content"]
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        return None

    async def count(self, text: str) -> int:
        ids = await self.encode(text)
        return len(ids) if ids is not None else len(text.split())


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def random_requests(tok: ServerTokenizer, cfg: BenchConfig) -> list[SampleRequest]:
    """Random token ids drawn from the server's own vocabulary (fixed seed); chat gets their text."""
    rng = random.Random(cfg.seed)
    text = " ".join(rng.choice(_WORDS) for _ in range(max(cfg.input_len * 4, 256)))
    pool = sorted(set(await tok.encode(text) or []))
    in_lens = _lengths(rng, cfg.num_prompts, cfg.input_len, cfg.range_ratio)
    out_lens = _lengths(rng, cfg.num_prompts, cfg.output_len, cfg.range_ratio)
    requests = []
    for in_len, out_len in zip(in_lens, out_lens):
        if not pool:  # no /tokenize: words (about one token each for common words)
            requests.append(SampleRequest(" ".join(rng.choice(_WORDS) for _ in range(in_len)), in_len, out_len))
            continue
        ids = [rng.choice(pool) for _ in range(in_len)]
        prompt: str | list[int] = ids
        if cfg.backend == "openai-chat":
            prompt = await tok.decode(ids) or " ".join(rng.choice(_WORDS) for _ in range(in_len))
        requests.append(SampleRequest(prompt, in_len, out_len))
    return requests


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the reply) of each ShareGPT conversation with at least two turns."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--dataset-path {path}: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations (ShareGPT format)")
    pairs = []
    for item in data:
        turns = (item.get("conversations") or item.get("conversation") or []) if isinstance(item, dict) else []
        if len(turns) >= 2 and all(isinstance(t, dict) and "value" in t for t in turns[:2]):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(
            f"--dataset-path {path}: no conversation with two turns "
            '({"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]})'
        )
    return pairs


async def sharegpt_requests(tok: ServerTokenizer, cfg: BenchConfig) -> list[SampleRequest]:
    """vLLM's sampling: shuffled with the seed; pairs with a prompt or reply under 4 tokens, a
    prompt over 1024 or a total over 2048 are skipped (unless the output length is fixed)."""
    pairs = read_sharegpt(cfg.dataset_path)
    random.Random(cfg.seed).shuffle(pairs)
    requests: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(requests) == cfg.num_prompts:
            break
        prompt_len = await tok.count(prompt)
        output_len = cfg.sharegpt_output_len or await tok.count(reply)
        if cfg.sharegpt_output_len is None and (
            prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048
        ):
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
    if len(requests) < cfg.num_prompts:
        logging.getLogger("engine.bench").warning(
            "the dataset gave %d usable prompts of the %d asked for", len(requests), cfg.num_prompts
        )
    return requests
