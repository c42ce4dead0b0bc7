"""Training drafts for speculative decoding (`kiln make-draft-model`): draft_training.py distils a
draft model or trains an EAGLE head (eagle_head.py) from the target's outputs. Offline tooling:
the serving engine never imports it."""
