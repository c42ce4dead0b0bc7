"""Speculative decoding on a GPU under CUDA graphs: a draft model, an EAGLE head and an EAGLE-3
head, each on an engine with `device="cuda", enforce_eager=False`, overlap scheduling on and off.

Per engine: greedy output equals plain eager decoding's (float32 on the torch backend: token for
token; bfloat16 on the CUTLASS kernels: differences only at near-ties of the eager logits, as in
tests/worker/test_cuda_graph.py), the target replayed verify graphs (keys (rows, ctx, q)) and the
drafter its own graphs, nothing was captured after start-up and Dynamo compiled nothing during
`generate`; and the step path (launch, sample) runs under torch.cuda.set_sync_debug_mode("error")
with no blocking upload counted (engine/worker/host_upload.py).

The CPU twins, in CI: tests/spec_decode/test_spec_models.py::test_draft_and_verify_steps_replay_graphs
(the same checks with simulated graphs) and tests/spec_decode/test_spec_uploads.py.

Overlap on and off on one engine: `async_scheduling` is read by the core at each step (nothing
else is built from it), so each engine runs its generations once with it on and once off; that
keeps each target's group (tools/gpu_check.sh spec-torch, spec-cutlass) to one compiled engine
per method plus the eager reference.
"""

from __future__ import annotations

import pytest
import torch

from compiler.compilation.capture import compile_count
from engine import SamplingParams
from engine.worker.host_upload import BlockingUploads
from tests.support.cuda_graph import NEAR_TIE, make_model, skip_unless_kernels_built

pytestmark = pytest.mark.gpu

K = 3
SIZES = [1, 2, 4]
MAX_MODEL_LEN = 256  # (prompts + outputs stay below the reference backend's first context bucket)
# target -> (dtype, attention backend)
TARGETS = {"torch": ("float32", "torch"), "cutlass": ("bfloat16", "cutlass")}
ENGINES = [
    ("torch", "draft_model"),
    ("torch", "eagle"),
    ("torch", "eagle3"),
    ("cutlass", "draft_model"),
    ("cutlass", "eagle3"),
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (int(n_),), generator=g).tolist() for n_ in torch.randint(4, 40, (n,), generator=g)]


PROMPTS = _prompts(6, seed=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The head_dim-64 target of the graph tests, a draft model (the target with noise on its
    layers: it agrees often, not always) and EAGLE / EAGLE-3 heads for it."""
    from engine.training.eagle_head import random_eagle
    from tests.support.spec_models import noisy_copy, target_weights

    root = tmp_path_factory.mktemp("spec-gpu")
    target = make_model(root / "target")
    cfg, embed, head = target_weights(root / "target")
    return {
        "target": target,
        "draft_model": str(noisy_copy(root / "target", root / "noisy", 0.05)),
        "eagle": str(random_eagle(root / "eagle", cfg, embed, head, 1, seed=1)),
        "eagle3": str(random_eagle(root / "eagle3", cfg, embed, head, 3, seed=2)),
        "cache": tmp_path_factory.mktemp("spec-gpu-compile"),
    }


def _settings(models, target: str, **kw) -> dict:
    dtype, backend = TARGETS[target]
    return dict(
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        max_num_seqs=SIZES[-1],
        cuda_graph_sizes=SIZES,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks=256,
        block_size=16,
        compile_cache_dir=str(models["cache"]),
        **kw,
    )


_REFERENCE: dict[str, dict] = {}


def _reference(models, target: str) -> dict:
    """Plain eager decoding of PROMPTS on this target (tokens and top-2 logprobs), once."""
    if target not in _REFERENCE:
        from engine.entrypoints.llm import LLM

        llm = LLM(models["target"], enforce_eager=True, async_scheduling=False, **_settings(models, target))
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False, logprobs=2)
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        _REFERENCE[target] = {"tokens": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs]}
        del llm
    return _REFERENCE[target]


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{t}-{m}" for t, m in ENGINES])
def spec_engine(request, models):
    target, method = request.param
    if TARGETS[target][1] == "cutlass":
        skip_unless_kernels_built(models["target"], "cutlass_v1", models["cache"])
    from engine.entrypoints.llm import LLM

    llm = LLM(
        models["target"],
        enforce_eager=False,
        speculative_method=method,
        speculative_model=models[method],
        num_speculative_tokens=K,
        **_settings(models, target),
    )
    core = llm.engine.core
    assert core.runner.graph_runner is not None and core.draft_runner.graph_runner is not None
    assert core.backend.name == TARGETS[target][1]
    return target, method, llm


def _check_greedy(target: str, got: list[list[int]], want: dict) -> None:
    if TARGETS[target][0] == "float32":
        assert got == want["tokens"]
        return
    ties = []
    for i, (tokens, mine) in enumerate(zip(want["tokens"], got)):
        k = next((j for j, (a, b) in enumerate(zip(tokens, mine)) if a != b), None)
        if k is None:
            assert len(tokens) == len(mine)
            continue
        top = sorted(want["logprobs"][i][k].values(), reverse=True)
        assert len(top) >= 2 and top[0] - top[1] < NEAR_TIE, (
            f"prompt {i}: spec decoding under graphs and eager differ at output {k} ({mine[k]} vs {tokens[k]}) "
            f"without a near-tie: {want['logprobs'][i][k]}"
        )
        ties.append((i, k))
    assert len(ties) <= len(got) // 3, f"too many divergences (near-ties): {ties}"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_spec_decoding_replays_graphs_and_equals_eager(models, spec_engine, overlap):
    target, method, llm = spec_engine
    core = llm.engine.core
    core.async_scheduling = overlap  # (read at each step: see the module docstring)
    want = _reference(models, target)
    verify, drafter = core.runner.graph_runner, core.draft_runner.graph_runner
    captured = (set(verify.graphs.graphs), set(drafter.graphs.graphs))
    assert any(len(key) == 3 for key in captured[0]), sorted(captured[0])  # verify graphs, at start-up
    verify_before = sum(n for key, n in verify.replayed.items() if len(key) == 3)
    drafter_before, compiles = drafter.num_replays, compile_count()
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert compile_count() == compiles, "Dynamo compiled during generate"
    assert (set(verify.graphs.graphs), set(drafter.graphs.graphs)) == captured, "a graph captured mid-serving"
    verify_replays = sum(n for key, n in verify.replayed.items() if len(key) == 3) - verify_before
    assert verify_replays > 0, sorted(verify.replayed.items())
    assert drafter.num_replays > drafter_before and not drafter.logits
    assert core.scheduler.spec.num_drafts > 0
    _check_greedy(target, got, want)
    core.check_integrity()
    print(
        f"{target} {method} overlap={overlap}: {verify_replays} verify replays, "
        f"{drafter.num_replays - drafter_before} drafter replays, drafter staging waits "
        f"{core.draft_runner.buffers.staging_waits}"
    )


def test_spec_step_never_syncs_the_host(models, spec_engine):
    """launch and sample of every step, draft and verify alike, under sync debug mode "error"
    (a host synchronisation inside raises) and with no blocking upload counted; greedy and seeded
    random requests side by side (rejection by equality and by the seeded race; draft q)."""
    target, method, llm = spec_engine
    core = llm.engine.core
    core.async_scheduling = True
    runner = core.runner
    counted: list[list[str]] = []
    real = {name: getattr(runner, name) for name in ("launch", "sample")}

    def strict(name):
        def call(*args, **kw):
            mode = BlockingUploads()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with mode:
                    return real[name](*args, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                counted.append(mode.where)

        return call

    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True, detokenize=False),
        SamplingParams(temperature=1.0, top_k=30, max_tokens=24, ignore_eos=True, detokenize=False),
    ]
    llm.generate(PROMPTS[:3], params, use_tqdm=False)  # (warm: first uses outside the checked window)
    runner.launch, runner.sample = strict("launch"), strict("sample")
    try:
        llm.generate(PROMPTS[3:6], params, use_tqdm=False)
    finally:
        runner.launch, runner.sample = real["launch"], real["sample"]
    assert len(counted) > 5 and not any(counted), [w for w in counted if w]
    core.check_integrity()
