"""Speculative decoding on the device: a draft model (draft_model.py) or an EAGLE head (eagle.py)
drafts inside each step's launch (proposal.py hands the drafts to the verify forward and the
sampler), and a verify step's outcome stays on the device for the step after it (verify.py)."""
