"""Make small random checkpoints in HF format, with a tokenizer trained here.

`kiln make-tiny-model DIR --arch llama|qwen2|qwen3|mistral` writes config.json,
model.safetensors and a byte-level BPE tokenizer (bos/eos, chat template). With
`--preset` and `--config-only` it writes a real-size config (and the tokenizer) for
`load_format=dummy` benchmarks. With `--train-steps N` the random model is then trained for N
Adam steps on the tokenizer's corpus (seconds on a CPU, seeded): it memorises the text, so
its next-token distributions are peaked and depend on attention, which makes it a gate for
numerical fidelity (an fp8 KV cache, a kernel) where a random model's near-flat logits flip on
any rounding. No model hub is needed anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A kiln is a thermally insulated chamber, a type of oven,
that produces temperatures sufficient to complete some process, such as hardening, drying, or chemical
changes. Kilns have been used for millennia to turn objects made from clay into pottery, tiles and bricks.
Large language models generate text one token at a time; each step reads the weights once from memory.
Paged attention stores the keys and values of every sequence in fixed-size blocks, like pages of memory.
Continuous batching lets new requests join a running batch at every step instead of waiting for it to end.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 42. Code: def f(x): return x * 2 + 1
Ünïcödé text: café, naïve, façade, smörgåsbord, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어, emoji 🙂🚀🔥.
The user asked a question and the assistant answered it clearly, briefly and politely.
"""

ARCH_DEFAULTS = {
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        attention_bias=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=False, tie_word_embeddings=True
    ),
    "phi3": dict(
        model_type="phi3", architectures=["Phi3ForCausalLM"], sliding_window=None, original_max_position_embeddings=1024
    ),
    "gemma": dict(
        model_type="gemma",
        architectures=["GemmaForCausalLM"],
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        head_dim=64,
    ),
    # Gemma 2: a window of 16 on every other layer (prompts of the tests are longer), capped
    # attention scores and logits, query_pre_attn_scalar unlike head_dim.
    "gemma2": dict(
        model_type="gemma2",
        architectures=["Gemma2ForCausalLM"],
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        sliding_window=16,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=5.0,
        query_pre_attn_scalar=24,
    ),
    # Gemma 3 (text): q/k norms, a local rotary base for the windowed layer, no caps.
    "gemma3": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        sliding_window=16,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    # Mixtures of experts: every layer sparse (Mixtral); a shared expert (Qwen2-MoE); a dense
    # layer among sparse ones and renormalised top-k (Qwen3-MoE).
    "mixtral": dict(
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        sliding_window=None,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=128,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        attention_bias=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
}

PRESETS = {
    "llama-3.2-1b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    # SmolLM2-135M's shape (the one real model reachable here ships as GGUF; this is its geometry).
    "smollm2-135m": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
}


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a small built-in corpus (any text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def tiny_config(arch: str, vocab_size: int, bos: int, eos: int, pad: int) -> dict:
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"--arch must be one of {', '.join(ARCH_DEFAULTS)}")
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,
        hidden_act="silu",
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
    )
    cfg.update(ARCH_DEFAULTS[arch])
    return cfg


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    preset: str | None = None,
    config_only: bool = False,
    overrides: dict | None = None,
    train_steps: int = 0,
) -> Path:
    import torch
    import transformers

    if train_steps < 0:
        raise ValueError(f"train_steps must be >= 0, got {train_steps}")
    if train_steps and (config_only or preset is not None):
        raise ValueError("--train-steps trains a tiny model: it does not go with --preset or --config-only")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(out)
    ids = dict(bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}")
        raw = dict(
            PRESETS[preset],
            hidden_act="silu",
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
        )
    else:
        raw = tiny_config(arch, len(tokenizer), ids["bos"], ids["eos"], ids["pad"])
    raw.update(overrides or {})
    if config_only:
        (out / "config.json").write_text(json.dumps(raw, indent=2))
        return out
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Non-trivial biases and norm weights, so that loading them wrongly shows.
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    if train_steps:
        train_on_corpus(model, tokenizer, train_steps, seed)
    model.save_pretrained(out, safe_serialization=True)
    config.save_pretrained(out)
    return out


def train_on_corpus(
    model, tokenizer, steps: int, seed: int, window: int = 64, batch: int = 8, lr: float = 1e-2
) -> float:
    """`steps` Adam steps of next-token loss on windows of the built-in corpus (bos + `window`
    tokens from a random offset of the repeated text, so every position is seen with and
    without long context); returns the last step's loss. Seeded: the same seed gives the same
    weights on the same machine. The learning rate decays linearly to a tenth, so the last
    steps settle rather than bounce. One thread: the model is too small to gain from more, and
    OpenMP threads on a loaded machine spin (measured: 5-20x slower on 2 shared cores); one
    thread also keeps the result independent of the machine's thread count."""
    import torch

    if steps < 0:
        raise ValueError(f"train_steps must be >= 0, got {steps}")
    ids = tokenizer(_CORPUS, add_special_tokens=False)["input_ids"]
    if len(ids) < window + 1:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than a training window of {window + 1}")
    stream = torch.tensor(ids * 2)  # wraps around: windows may cross the end into the start
    bos = torch.full((batch, 1), tokenizer.bos_token_id)
    vocab = len(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * i / steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    try:
        loss = float("nan")
        for _ in range(steps):
            starts = torch.randint(0, len(ids), (batch,), generator=gen)
            text = stream[starts[:, None] + torch.arange(window)]
            # Half the rows open with up to `window // 4` random tokens (unscored) before the
            # text: the model learns to fall into the corpus after text it has never seen.
            noise = torch.randint(len(SPECIAL_TOKENS), vocab, (batch, window), generator=gen)
            lead = torch.randint(0, window // 4 + 1, (batch, 1), generator=gen)
            lead = torch.where(torch.rand(batch, 1, generator=gen) < 0.5, lead, 0)
            pos = torch.arange(window)
            body = torch.where(pos < lead, noise, text.gather(1, (pos - lead).clamp_min(0)))
            x = torch.cat([bos, body], dim=1)
            target = torch.where(pos < lead, -100, body)
            logits = model(input_ids=x).logits[:, :-1]
            step_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
            opt.zero_grad()
            step_loss.backward()
            opt.step()
            sched.step()
            loss = step_loss.item()
    finally:
        torch.set_num_threads(threads)
        model.eval()
    return loss


def make_periodic_model(out_dir: str | Path, period: int = 8, mix: float = 0.02, seed: int = 0) -> Path:
    """A tiny llama that mostly repeats itself: its greedy continuation of token t is the next
    token of t's group of `period` ids (lm_head row P(t) is t's embedding, scaled), so outputs
    cycle with that period. Attention and MLP outputs are scaled by `mix`: small enough to keep
    the cycle, large enough that wrong KV changes the logits. What n-gram speculative decoding
    is built for, without a trained model (tests and `kiln bench spec`)."""
    import torch
    from safetensors.torch import save_file

    from engine.models.loader.safetensors_reader import read_tensors

    out = make_tiny_model(out_dir, arch="llama", seed=seed)
    weights = read_tensors(out / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    vocab = embed.shape[0]
    cycled = vocab - vocab % period
    succ = [period * (t // period) + (t + 1) % period if t < cycled else t for t in range(vocab)]
    head = torch.empty_like(embed)
    head[torch.tensor(succ)] = embed * 4.0
    weights["lm_head.weight"] = head
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * mix
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def default_model_dir(cache_dir: Path) -> Path:
    """The embedded default model: made once into kiln's cache directory."""
    path = cache_dir / "default-model-llama"
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        tmp = path.with_name(path.name + ".tmp")
        make_tiny_model(tmp, arch="llama", seed=0)
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
    return path
