"""Verify graphs (rows * q tokens) never read past the static buffers: a bucket whose verify step
exceeds the input buffers' rows, or those of EAGLE's aux_hidden / hidden_in, gets no graph (one log
line at start-up) and its steps run eagerly; every q = 2..Q is captured at start-up, bucket 1's
verify graph with the compiled steps' two rows; simulated graphs on the CPU, a small config."""

from __future__ import annotations

import logging

import pytest
import torch

SIZES = [1, 2, 4, 8]
Q = 5  # 1 + 4 drafts


@pytest.mark.parametrize(
    "buffer, rows, fit", [(None, None, [1, 2, 4]), ("aux_hidden", 12, [1, 2]), ("hidden_in", 10, [1, 2])]
)
def test_verify_buckets_past_the_buffers_are_skipped(make_llm, caplog, buffer, rows, fit):
    llm = make_llm(max_num_seqs=8, max_num_batched_tokens=16)
    runner = llm.engine.core.runner
    assert runner.buffers.max_tokens == 20  # max(16 tokens, 9 rows) + the compiled steps' padding rows
    model = runner.model
    if buffer is not None:  # (the target's EAGLE-3 states, an EAGLE head's input: fewer rows here)
        setattr(model, buffer, torch.zeros(rows, model.config.hidden_size))
    runner.builder.compiled = True  # (padded steps, as graphs read them; the forward stays eager)
    try:
        with caplog.at_level(logging.INFO, logger="engine.worker.decode_graphs"):
            runner.capture_graphs(SIZES, device_reads_lengths=False, simulate=True, max_query=Q)
    finally:
        if buffer is not None:
            setattr(model, buffer, None)
    graphs = runner.graph_runner
    keys = set(graphs.graphs.graphs)
    ctx = graphs.key_for(1, 1)[1]
    decode = [b for b in SIZES if b <= graphs.max_tokens]  #
    assert sorted(k[0] for k in keys if len(k) == 2) == decode
    # every q = 2..Q captured at start-up, each with the buckets whose rows * q fit; a verify graph
    # has at least MIN_COMPILED_ROWS (2) rows: bucket 1 is padded to 2
    for q in range(2, Q + 1):
        rows = sorted({max(b, 2) for b in SIZES if max(b, 2) * q <= graphs.max_tokens})
        assert sorted(k[0] for k in keys if len(k) == 3 and k[2] == q) == rows, (q, sorted(keys))
    verify = sorted({max(b, 2) for b in fit})
    assert sorted(k[0] for k in keys if len(k) == 3 and k[2] == Q) == verify
    skipped = [b for b in SIZES if b not in fit]
    assert f"no verify CUDA graph for batch {','.join(map(str, skipped))}" in caplog.text
    for seqs in range(1, 9):  # a step's key: none (eager) where its bucket's verify rows exceed the buffers
        key = graphs.key_for(seqs, 1, Q)
        assert (key is None) == (key_bucket(seqs) not in fit), (seqs, key)
        assert key is None or key == (max(key_bucket(seqs), 2), ctx, Q)
        assert graphs.key_for(seqs, 1) == ((key_bucket(seqs), ctx) if key_bucket(seqs) in decode else None)


def key_bucket(seqs: int) -> int:
    return next(b for b in SIZES if b >= seqs)
