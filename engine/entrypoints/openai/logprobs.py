"""Logprobs in the OpenAI formats: completions' parallel lists, chat's per-token objects, and
vLLM's prompt_logprobs."""

from __future__ import annotations

from engine.core.outputs import RequestOutput


class LogprobFormat:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion(self, ch, token_ids: list[int], entries: list[dict[int, float]]) -> dict:
        """Completions' {tokens, token_logprobs, top_logprobs, text_offset}; ch.text_offset advances."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            s = self.token_text(tid)
            tokens.append(s)
            token_lps.append(entry.get(tid))
            tops.append({self.token_text(t): v for t, v in entry.items()})
            offsets.append(ch.text_offset)
            ch.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def echo(
        self, prompt_ids: list[int], prompt_entries: list[dict[int, float] | None] | None, prefix: str, lp: dict
    ) -> dict:
        """Echoed prompt tokens come first, with their prompt logprobs (the first has none)."""
        toks = [self.token_text(t) for t in prompt_ids]
        entries = prompt_entries if prompt_entries is not None else [None] * len(prompt_ids)
        offsets, pos = [], 0
        for s in toks:
            offsets.append(pos)
            pos += len(s)
        token_lps = [None if e is None else e.get(t) for t, e in zip(prompt_ids, entries)]
        tops = [None if e is None else {self.token_text(t): v for t, v in e.items()} for e in entries]
        return {
            "tokens": toks + lp["tokens"],
            "token_logprobs": token_lps + lp["token_logprobs"],
            "top_logprobs": tops + lp["top_logprobs"],
            "text_offset": offsets + [o + len(prefix) for o in lp["text_offset"]],
        }

    def prompt(self, out: RequestOutput | None) -> list | None:
        """vLLM's `prompt_logprobs` field: per prompt token None (the first) or
        {token id: {logprob, rank, decoded_token}} (kiln does not compute ranks: null)."""
        if out is None or out.prompt_logprobs is None:
            return None
        return [
            None
            if e is None
            else {str(t): {"logprob": v, "rank": None, "decoded_token": self.token_text(t)} for t, v in e.items()}
            for e in out.prompt_logprobs
        ]

    def chat(self, token_ids: list[int], entries: list[dict[int, float]], top_n: int) -> list[dict]:
        out = []
        for tid, entry in zip(token_ids, entries):
            s = self.token_text(tid)
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            out.append(
                {
                    "token": s,
                    "logprob": entry.get(tid),
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [
                        {"token": (t_s := self.token_text(t)), "logprob": v, "bytes": list(t_s.encode("utf-8"))}
                        for t, v in top
                    ],
                }
            )
        return out
