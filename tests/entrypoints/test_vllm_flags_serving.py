"""vLLM flags kiln implements, seen from a client or the loader: --default-chat-template-kwargs,
--override-generation-config, the CORS flags, --load-format safetensors|gguf."""

from __future__ import annotations

import asyncio

import pytest

from engine.config.server_settings import ServerSettings
from engine.config.sources import SettingsError

TEMPLATE = (
    "{% if enable_thinking %}THINKING ON{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_defaults_and_generation_overrides(tiny_llama):
    from tests.support.engine import served

    server = {"default_chat_template_kwargs": {"enable_thinking": True}}
    overrides = {"max_new_tokens": 3, "temperature": 0}
    with served(tiny_llama, server, chat_template=TEMPLATE, override_generation_config=overrides) as (_, _, client):

        async def main():
            ask = dict(model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True})
            default = await client.chat.completions.create(**ask)
            off = await client.chat.completions.create(
                **{**ask, "extra_body": {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}}
            )
            assert default.usage.prompt_tokens > off.usage.prompt_tokens  # the server's default applied
            assert default.usage.completion_tokens == 3  # --override-generation-config's max_new_tokens
            again = await client.chat.completions.create(**ask)
            assert again.choices[0].message.content == default.choices[0].message.content  # temperature 0

        asyncio.run(main())


def test_cors_flags():
    import httpx
    from fastapi import FastAPI

    from engine.entrypoints.openai.http_options import add_http_middleware

    app = FastAPI()
    settings = ServerSettings(
        allowed_origins=["http://ui.example"], allow_credentials=True, allowed_methods=["GET", "POST"]
    )
    add_http_middleware(app, settings)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            ask = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
            preflight = await http.options("/v1/chat/completions", headers=ask)
            assert preflight.headers["access-control-allow-credentials"] == "true"
            methods = preflight.headers["access-control-allow-methods"]
            assert "POST" in methods and "PUT" not in methods
            refused = await http.options(
                "/v1/chat/completions", headers={**ask, "Access-Control-Request-Method": "PUT"}
            )
            assert refused.status_code == 400

    asyncio.run(main())


def test_template_defaults_may_not_set_what_kiln_sets():
    with pytest.raises(Exception, match="may not set tools"):
        ServerSettings(default_chat_template_kwargs={"tools": []})
    assert issubclass(SettingsError, ValueError)


def test_load_format_names_the_checkpoint_format(tiny_llama):
    import torch

    from engine.models.config import ModelConfig
    from engine.models.loader.model_loader import load_model

    config = ModelConfig.from_dir(tiny_llama)
    with pytest.raises(ValueError, match="is not a gguf checkpoint"):
        load_model(tiny_llama, config, torch.float32, torch.device("cpu"), 16, load_format="gguf")
    model = load_model(tiny_llama, config, torch.float32, torch.device("cpu"), 16, load_format="safetensors")
    reference = load_model(tiny_llama, config, torch.float32, torch.device("cpu"), 16)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
