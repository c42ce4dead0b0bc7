"""InputBuffers.write_table_rows: after every step each row of the host block table holds its
sequence's blocks, whatever changed in between (rows shifting up as sequences leave, tables
growing, copy-on-write replacing an entry, new sequences, reordering). As the worker's own
tables (engine/worker/seq_states.py), a table grows in place and is otherwise a new list."""

from __future__ import annotations

import random

import torch

from engine.worker.input_buffers import InputBuffers


class _Seq:
    def __init__(self, rng: random.Random, next_block: list[int]) -> None:
        self.blocks = [self._new(next_block) for _ in range(rng.randint(1, 4))]

    @staticmethod
    def _new(next_block: list[int]) -> int:
        next_block[0] += 1
        return next_block[0]


def _check(buf: InputBuffers, seqs: list[_Seq]) -> None:
    for i, s in enumerate(seqs):
        assert buf.np_block_tables[i, : len(s.blocks)].tolist() == s.blocks, f"row {i}"


def test_block_table_rows_follow_their_sequences_through_random_steps():
    rng = random.Random(0)
    buf = InputBuffers(max_tokens=64, max_seqs=24, max_blocks_per_seq=16, device=torch.device("cpu"))
    counter = [0]
    seqs = [_Seq(rng, counter) for _ in range(12)]
    for step in range(400):
        event = rng.random()
        if event < 0.25 and seqs:  # one or more sequences leave: the rows after them move up
            for _ in range(rng.randint(1, 3)):
                if seqs:
                    seqs.pop(rng.randrange(len(seqs)))
        elif event < 0.4 and len(seqs) < 20:  # newcomers, anywhere (a more urgent one goes first)
            seqs.insert(rng.randint(0, len(seqs)), _Seq(rng, counter))
        elif event < 0.45 and len(seqs) > 1:  # an order change (preemption and re-admission)
            rng.shuffle(seqs)
        for s in seqs:
            if rng.random() < 0.2 and len(s.blocks) < 16:  # a decode crossed into a new block
                s.blocks.append(_Seq._new(counter))
            if rng.random() < 0.03:  # copy-on-write: an entry replaced (a new table)
                s.blocks = list(s.blocks)
                s.blocks[rng.randrange(len(s.blocks))] = _Seq._new(counter)
            if rng.random() < 0.02 and len(s.blocks) > 1:  # rejected drafts: blocks trimmed (a new table)
                s.blocks = s.blocks[: rng.randint(1, len(s.blocks) - 1)]
        buf.write_table_rows([(s.blocks, len(s.blocks)) for s in seqs])
        _check(buf, seqs)
        buf.upload(1, len(seqs), 16)


class _FakeEvent:
    """A CUDA event's interface: recorded copies run only when a later take finds them due."""

    def __init__(self) -> None:
        self.done = True

    def record(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_staging_ring_waits_only_for_the_copies_of_the_slot_it_reuses():
    """A proposer's runner builds k + 1 forwards a step: with one staging set each build waits
    for the previous one's copies (which queue behind the previous forward); with a ring of
    slots the host waits only when it comes round to a slot whose copies have not run."""
    from engine.worker.input_buffers import StagingRing

    def builds(slots: int, n: int) -> int:
        ring = StagingRing([{} for _ in range(slots)], _FakeEvent)
        for _ in range(n):  # (the device runs nothing meanwhile: the worst case for the host)
            ring.take()
            ring.in_use()
        return ring.waits

    assert builds(1, 8) == 7  # every build after the first waits
    assert builds(8, 8) == 0  # a step of up to 8 forwards queues without a wait
    assert builds(4, 8) == 4  # the fifth build reuses the first slot: from then on, one wait a build
    ring = StagingRing([{} for _ in range(4)], _FakeEvent)
    for _ in range(12):  # copies that have run by the time their slot comes round: no wait
        ring.take()
        ring.in_use()
        ring.events[ring.current].synchronize()
    assert ring.waits == 0


def test_the_cpu_stages_nothing():
    """On the CPU the host arrays are the device tensors: one set, no ring, no event."""
    buf = InputBuffers(max_tokens=16, max_seqs=4, max_blocks_per_seq=4, device=torch.device("cpu"))
    buf.use_staging_ring(8)
    buf.wait_staging()
    assert buf.input_ids is buf.input_ids_host and buf.np_input_ids.base is not None
    assert len(buf._ring.slots) == 1 and buf._ring.events is None and buf.staging_waits == 0
