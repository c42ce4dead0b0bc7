"""Cache-aware vs round-robin routing over kiln replicas: prefix-cache hit rate and wall time.

    python tools/bench_replicas.py [--replicas 2] [--groups 8] [--per-group 16] [kiln serve flags...]

Each policy gets a fresh set of replicas (`kiln serve-replicas` machinery) and the same workload:
GROUPS long system prompts, PER_GROUP questions each, shuffled, CONCURRENCY at a time. Prints
both policies' numbers and the ratios cache_aware / round_robin from the same run.
"""

from __future__ import annotations

import argparse
import random
import re
import socket
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.entrypoints.cli.replicas import ReplicaPlan, ReplicaSet  # noqa: E402


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_policy(policy: str, args, serve_args: list[str], prompts: list[str]) -> dict:
    import openai

    base = _free_port()
    plan = ReplicaPlan(
        replicas=args.replicas,
        host="127.0.0.1",
        port=_free_port(),
        replica_port=base + 1,
        policy=policy,
        router_metrics_port=_free_port(),
        serve_args=serve_args,
        log_dir=Path(tempfile.mkdtemp(prefix=f"bench-replicas-{policy}-")),
    )
    replica_set = ReplicaSet(plan)
    try:
        replica_set.start()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{plan.port}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def one(prompt):
            return client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0)

        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, prompts))
        wall = time.perf_counter() - start
        assert all(r.choices for r in results)
        urls = plan.replica_urls()
        served = [_metric(u, "kiln:request_success_total") for u in urls]
        hits = sum(_metric(u, "kiln:prefix_cache_hits_total") for u in urls)
        queries = sum(_metric(u, "kiln:prefix_cache_queries_total") for u in urls)
        return {"wall_s": wall, "hit_rate": hits / max(queries, 1), "served": served}
    finally:
        replica_set.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8, help="distinct long system prompts")
    parser.add_argument("--per-group", type=int, default=16, help="questions per system prompt")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args, serve_args = parser.parse_known_args()
    serve_args = serve_args or ["--device", "cpu", "--enforce-eager"]
    rng = random.Random(args.seed)
    prompts = []
    for g in range(args.groups):
        system = f"System prompt {g}: " + " ".join(
            f"rule {g}.{i} says item {rng.randrange(10**6)} matters;" for i in range(12)
        )
        prompts += [f"{system} Question {q}: what about case {rng.randrange(10**6)}?" for q in range(args.per_group)]
    rng.shuffle(prompts)
    results = {p: run_policy(p, args, serve_args, prompts) for p in ("round_robin", "cache_aware")}
    for policy, r in results.items():
        print(
            f"{policy:12s} wall {r['wall_s']:.2f} s  prefix-cache hit rate {100 * r['hit_rate']:.1f}%  "
            f"requests per replica {[int(x) for x in r['served']]}"
        )
    rr, ca = results["round_robin"], results["cache_aware"]
    hit_ratio = f"{ca['hit_rate'] / rr['hit_rate']:.2f}x" if rr["hit_rate"] else "n/a (round_robin hit no prefix)"
    print(
        f"ratio cache_aware/round_robin: hit rate {hit_ratio}, wall time {ca['wall_s'] / rr['wall_s']:.2f}x "
        f"({len(prompts)} requests, {args.replicas} replicas)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
