"""`kiln make-draft-model`: make a draft for speculative decoding from the target itself.

No draft is reachable here for the one real model (SmolLM2-135M-Instruct), so this trains one
on the CPU (SmolLM2-135M on 2 cores: the corpus ~30 min once, then ~10 min of training for a
draft model, ~11 min of the target's hidden states once and ~15 min of training for an EAGLE-3
head), and any target gets one the same way:

  1. a corpus: kiln generates the target's own answers to 1,024 chat prompts (built-in templates
     over topics, with training-only ones; never the topics `kiln bench spec` asks about), half
     greedy, half sampled at temperature 0.8, at batch 64, recording the target's top-16
     log-probabilities at every answer position; cached in kiln's cache, one corpus for every
     method;
  2. --method draft_model: a small narrow Llama with the target's tokenizer trained from
     scratch (--init scratch, the default; its embeddings start as the target's projected onto
     their principal directions), or one cut from the target (--init target: its embeddings,
     tied LM head, final norm and a few of its layers, --target-layers, the leading
     --frozen-layers kept as they are), trained to match the target's next-token distributions
     (the corpus's top-16 log-probabilities) over a draft
     vocabulary of the --draft-vocab most used tokens, which the draft proposes from
     (draft_vocab.json: the LM head it evaluates is that many rows, not the target's 49k).
     Saved as an HF checkpoint with the tokenizer;
     --method eagle / eagle3: an EAGLE (EAGLE-3) head trained on the target's hidden states over
     the corpus (transformers computes them), in the public checkpoint layout; EAGLE-3's draft
     vocabulary is the corpus's most frequent tokens.

The result goes to kiln's cache (cache_dir/drafts/<target>-<method>), like the tiny model, and
is reused unless --force; the path is printed. Use it with
    --speculative-config '{"method": "<method>", "model": "<path>", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import time
from pathlib import Path

logger = logging.getLogger(__name__)

TEMPLATES = [
    "Explain {t} in simple terms.",
    "What are the main benefits of {t}?",
    "Write a short paragraph about {t}.",
    "Give me three tips about {t}.",
    "How does {t} work?",
    "What is the history of {t}?",
    "Describe {t} to a ten-year-old.",
    "What are common mistakes people make with {t}?",
    "Summarize the key ideas of {t}.",
    "Why is {t} important?",
    "Write a haiku about {t}.",
    "List five facts about {t}.",
]
TOPICS = [
    "photosynthesis",
    "the water cycle",
    "machine learning",
    "compound interest",
    "volcanoes",
    "the French Revolution",
    "healthy sleep",
    "learning a new language",
    "black holes",
    "recycling",
    "electric cars",
    "the immune system",
    "cloud computing",
    "gardening",
    "the stock market",
    "climate change",
    "the internet",
    "public speaking",
    "time management",
    "the solar system",
    "vaccines",
    "renewable energy",
    "coffee",
    "baking bread",
    "chess",
    "meditation",
    "earthquakes",
    "the Roman Empire",
    "credit scores",
    "nutrition",
    "running a marathon",
    "honey bees",
    "ocean tides",
    "3D printing",
    "blockchains",
    "DNA",
    "the printing press",
    "jazz music",
    "city planning",
    "first aid",
    "bicycles",
    "rainbows",
    "human memory",
    "music theory",
    "photography",
    "job interviews",
    "personal budgeting",
    "the moon",
    "dinosaurs",
    "antibiotics",
    "solar panels",
    "wind turbines",
    "the human heart",
    "programming in Python",
    "databases",
    "writing an essay",
    "teamwork",
    "cooking pasta",
    "camping",
    "bird migration",
    "the Olympic Games",
    "electricity",
    "friendship",
    "the Great Wall of China",
    "origami",
    "glaciers",
    "yoga",
    "submarines",
    "the theory of evolution",
    "smartphones",
    "coral reefs",
    "volunteering",
]


# Training-only prompts (never asked by `kiln bench spec`): more instructions and more topics,
# for a corpus wide enough that a draft learns the target's style, not its answers.
TRAIN_TEMPLATES = [
    "Can you tell me about {t}?",
    "What should a beginner know about {t}?",
    "Compare {t} with something similar.",
    "Write a short story involving {t}.",
    "What are the pros and cons of {t}?",
    "Explain {t} step by step.",
    "What questions do people often ask about {t}?",
    "Give an example that illustrates {t}.",
    "Write an email to a friend about {t}.",
    "What is the future of {t}?",
    "Define {t} in one sentence.",
    "Teach me something surprising about {t}.",
]
TRAIN_TOPICS = [
    "knitting",
    "the Renaissance",
    "quantum computing",
    "rivers",
    "sleep apnea",
    "soccer",
    "taxes",
    "volcanologists",
    "the Amazon rainforest",
    "nuclear power",
    "sourdough",
    "podcasts",
    "spreadsheets",
    "airplanes",
    "the ocean floor",
    "linear algebra",
    "poetry",
    "mushrooms",
    "cybersecurity",
    "the Industrial Revolution",
    "tea",
    "sharks",
    "robots",
    "ancient Egypt",
    "email etiquette",
    "houseplants",
    "the human brain",
    "mountains",
    "video games",
    "statistics",
    "the Milky Way",
    "wolves",
    "deserts",
    "trains",
    "cheese making",
    "the piano",
    "weather forecasting",
    "saving for retirement",
    "social media",
    "open source software",
    "hiking",
    "painting",
    "kindness",
    "the periodic table",
    "elephants",
    "satellites",
    "fermentation",
    "negotiation",
    "the Moon landing",
    "web browsers",
    "insurance",
    "calculus",
    "composting",
    "penguins",
    "the Silk Road",
    "handwriting",
    "algorithms",
    "lighthouses",
    "skin care",
    "the metric system",
]


def chat_prompts(split: str) -> list[str]:
    """The built-in chat prompts: `test` asks about every fifth topic, `train` about the others
    (a draft is never trained on what the benchmark asks); `train-wide` adds the training-only
    templates and topics to `train`."""
    topics = [t for i, t in enumerate(TOPICS) if (i % 5 == 0) == (split == "test")]
    if split != "train-wide":
        return [template.format(t=topic) for topic in topics for template in TEMPLATES]
    return [template.format(t=topic) for topic in topics + TRAIN_TOPICS for template in TEMPLATES + TRAIN_TEMPLATES]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def build_labelled_corpus(
    target: str,
    cache: Path,
    num_prompts: int,
    max_tokens: int,
    seed: int,
    top_k: int = 16,
    batch: int = 64,
    log=logger.info,
) -> list[dict]:
    """The target's own answers to num_prompts `train-wide` prompts (each prompt once, in a
    seeded order; half answered greedily, half sampled at temperature 0.8), generated by kiln at
    batch `batch`, with the target's top_k next-token log-probabilities at every answer position
    (its raw distribution: soft labels for distillation, no second pass over the corpus). Cached
    in kiln's cache: a list of {"ids": [T] int64 (prompt + answer), "prompt": int, "top_ids":
    [A, top_k] int32, "top_lp": [A, top_k] float16} (A = answer length)."""
    import torch

    key = hashlib.sha1(f"labelled:{Path(target).resolve()}:{num_prompts}:{max_tokens}:{seed}:{top_k}".encode())
    file = cache / f"corpus-{Path(target).stem}-{key.hexdigest()[:12]}.pt"
    if file.is_file():
        return torch.load(file, weights_only=True)
    from engine.core.params import SamplingParams
    from engine.entrypoints.llm import LLM

    prompts = chat_prompts("train-wide")
    random.Random(seed).shuffle(prompts)
    if num_prompts > len(prompts):
        raise SystemExit(f"kiln make-draft-model: at most {len(prompts)} training prompts, asked for {num_prompts}")
    prompts = prompts[:num_prompts]
    llm = LLM(
        target,
        device="cpu",
        dtype="float32",
        max_model_len=max(1024, 4 * max_tokens),
        max_num_seqs=batch,
        kv_cache_memory_gb=2.0,
    )
    ids = [chat_ids(llm.tokenizer, p) for p in prompts]
    t0 = time.perf_counter()
    half = len(ids) // 2
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=top_k, detokenize=False)
    sampled = SamplingParams(temperature=0.8, max_tokens=max_tokens, logprobs=top_k, seed=seed, detokenize=False)
    outs = llm.generate(ids[:half], greedy, use_tqdm=False) + llm.generate(ids[half:], sampled, use_tqdm=False)
    corpus = []
    for p, o in zip(ids, outs):
        out = o.outputs[0]
        top_ids = torch.zeros(len(out.token_ids), top_k, dtype=torch.int32)
        top_lp = torch.full((len(out.token_ids), top_k), -float("inf"), dtype=torch.float16)
        for row, lps in enumerate(out.logprobs):
            best = sorted(lps.items(), key=lambda kv: -kv[1])[:top_k]
            top_ids[row, : len(best)] = torch.tensor([t for t, _ in best], dtype=torch.int32)
            top_lp[row, : len(best)] = torch.tensor([lp for _, lp in best], dtype=torch.float16)
        corpus.append(
            {"ids": torch.tensor(p + list(out.token_ids)), "prompt": len(p), "top_ids": top_ids, "top_lp": top_lp}
        )
    n = sum(len(c["top_ids"]) for c in corpus)
    log(f"corpus: {len(corpus)} answers, {n} generated tokens in {time.perf_counter() - t0:.0f}s")
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(corpus, file)
    return corpus


def main(argv: list[str]) -> int:
    from engine.config.settings_base import default_cache_dir

    parser = argparse.ArgumentParser(
        prog="kiln make-draft-model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="the target checkpoint (directory or .gguf file)")
    parser.add_argument("--method", required=True, choices=["draft_model", "eagle", "eagle3"])
    parser.add_argument("--out", default=None, help="output directory (default: kiln's cache, drafts/)")
    parser.add_argument(
        "--cache-dir", default=None, help="kiln's cache root (default: KILN_CACHE_DIR or ~/.cache/kiln)"
    )
    parser.add_argument(
        "--init",
        choices=["scratch", "target"],
        default="scratch",
        help="draft_model: a narrow model from scratch (default) or cut from the target's own layers",
    )
    parser.add_argument("--prompts", type=int, default=None, help="corpus answers to generate (default: 1024)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default: 128)")
    parser.add_argument(
        "--epochs", type=int, default=None, help="training passes (default: 10; draft_model --init target: 2)"
    )
    parser.add_argument(
        "--target-layers",
        default="0,1,2,3,28,29",
        help="draft_model --init target: the target's layers the draft keeps (default: 0,1,2,3,28,29)",
    )
    parser.add_argument(
        "--frozen-layers",
        type=int,
        default=4,
        help="draft_model --init target: leading kept layers not trained (default: 4)",
    )
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: per method)")
    parser.add_argument(
        "--layers", type=int, default=None, help="draft_model --init scratch: layers (default 4); eagle: layers (1)"
    )
    parser.add_argument("--hidden-size", type=int, default=256, help="draft_model --init scratch: width (default: 256)")
    parser.add_argument(
        "--draft-vocab", type=int, default=8192, help="eagle3 and draft_model: draft vocabulary (default: 8192)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="train again even if the cache has it")
    args = parser.parse_args(argv)
    cache = (Path(args.cache_dir) if args.cache_dir else default_cache_dir()) / "drafts"
    out = Path(args.out) if args.out else cache / f"{Path(args.target).stem}-{args.method}"
    if (out / "config.json").is_file() and not args.force:
        print(out)
        return 0
    from engine.training.draft_distill import distill_draft_model, distill_from_target
    from engine.training.eagle_training import train_eagle_for
    from engine.training.teacher import teacher_pass

    if args.method == "draft_model":
        t0 = time.perf_counter()
        labelled = build_labelled_corpus(args.target, cache, args.prompts or 1024, args.max_tokens or 128, args.seed)
        if args.init == "target":
            layers = [int(x) for x in args.target_layers.split(",")]
            distill_from_target(
                args.target,
                labelled,
                out,
                layers,
                draft_vocab=args.draft_vocab,
                frozen=args.frozen_layers,
                epochs=args.epochs or 2,
                lr=args.lr or 1e-3,
                seed=args.seed,
                log=logger.info,
            )
        else:
            distill_draft_model(
                args.target,
                labelled,
                out,
                layers=args.layers or 4,
                hidden=args.hidden_size,
                draft_vocab=args.draft_vocab,
                epochs=args.epochs or 10,
                lr=args.lr or 3e-3,
                seed=args.seed,
                log=logger.info,
            )
        logger.info("draft_model made in %.0fs (the corpus included unless cached): %s", time.perf_counter() - t0, out)
        print(out)
        return 0
    # (the draft model's corpus: its answers, the hidden states come from the teacher pass)
    labelled = build_labelled_corpus(args.target, cache, args.prompts or 1024, args.max_tokens or 128, args.seed)
    corpus = [(c["ids"].tolist(), int(c["prompt"])) for c in labelled]
    key = hashlib.sha1(json.dumps(corpus).encode()).hexdigest()[:12]
    t0 = time.perf_counter()
    teacher = teacher_pass(
        args.target, [ids for ids, _ in corpus], cache / f"teacher-{Path(args.target).stem}-{key}.pt", log=logger.info
    )
    train_eagle_for(
        args.target,
        corpus,
        teacher,
        out,
        version=3 if args.method == "eagle3" else 1,
        epochs=args.epochs or 10,
        draft_vocab=args.draft_vocab,
        seed=args.seed,
        layers=args.layers or 1,
        log=logger.info,
    )
    logger.info("%s draft trained in %.0fs: %s", args.method, time.perf_counter() - t0, out)
    print(out)
    return 0
