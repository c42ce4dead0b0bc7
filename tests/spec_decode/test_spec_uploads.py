"""A speculative step makes no host -> device upload that would block the host on a GPU: every
index list of the step path (the step builder's position shifts and verified feeds, the
proposers' row picks, the verify outcome, draft sampling, rejection sampling, the sampler) goes
through pinned memory without blocking (engine/worker/host_upload.py). On the CPU the calls are
counted by their form (engine.worker.host_upload.BlockingUploads): what each would do on a GPU.
The GPU twin runs under torch.cuda.set_sync_debug_mode("error") (tests/spec_decode/test_spec_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.worker.host_upload import BlockingUploads, upload
from tests.support.spec_models import PROMPTS, spec_settings


def _count_uploads(runner) -> list[list[str]]:
    """Wrap the runner's launch and sample (the step path) in a BlockingUploads mode; each call's
    counted uploads are appended to the returned list."""
    seen: list[list[str]] = []
    for name in ("launch", "sample"):
        real = getattr(runner, name)

        def counted(*args, _real=real, **kw):
            with BlockingUploads() as mode:
                out = _real(*args, **kw)
            seen.append(mode.where)
            return out

        setattr(runner, name, counted)
    return seen


@pytest.mark.parametrize(
    "method,draft,overlap",
    [
        ("draft_model", "noisy", False),
        ("draft_model", "noisy", True),
        ("eagle", "eagle", True),
        ("eagle3", "eagle3", False),
    ],
)
def test_spec_steps_make_no_blocking_upload(spec_models, make_llm, method, draft, overlap):  # noqa: F811
    """Greedy, seeded and unseeded random requests with penalties, top-k/top-p and logit bias side
    by side (rejection sampling with q, the seeded race, penalties over drafts): no step, draft
    or verify, counts a blocking upload."""
    llm = make_llm(
        spec_models["target"], async_scheduling=overlap, max_num_seqs=4, **spec_settings(spec_models, method, draft)
    )
    seen = _count_uploads(llm.engine.core.runner)
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, presence_penalty=0.5, logit_bias={7: 1.0}),
        SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2, max_tokens=16, ignore_eos=True),
    ]
    llm.generate(PROMPTS[:4], params, use_tqdm=False)
    spec = llm.engine.core.scheduler.spec
    assert spec.num_drafts > 0  # (verify steps ran)
    assert len(seen) > 10 and not any(seen), [w for w in seen if w]


def test_the_count_sees_a_blocking_upload():
    """The check can fail: the forms a GPU would block on are counted, `upload`'s is not."""
    cpu = torch.device("cpu")
    with BlockingUploads() as mode:
        torch.tensor([1, 2], device=cpu)
        torch.tensor([3]).to(cpu)
        torch.tensor([4]).to(cpu, non_blocking=True)  # (pageable memory: the host still waits)
        upload([5, 6], torch.int64, cpu)
        torch.zeros(2).to(torch.int64)  # (a dtype cast: no copy between devices)
    assert len(mode.where) == 3, mode.where
