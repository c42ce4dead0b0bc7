"""Speculative decoding, both sides.

sched/ is the scheduler's side (plain Python, no torch): what drafts a sequence gets (n-gram
lookup in ngram.py, or how many a device proposer makes in draft_length.py) and which of them a
verify step keeps (decoder.py's SpecDecoder, which the runtime builder hands to the scheduler).

The rest runs on the device: a draft model (draft_model.py) or an EAGLE head (eagle.py) drafts
inside each step's launch, proposal.py hands the drafts to the verify forward and the sampler,
rejection.py accepts or rejects sampled drafts, and verify.py keeps a verify step's outcome on
the device for the step after it. The draft models themselves are model definitions:
engine/models/draft.py and engine/models/eagle.py."""
