"""Training drafts for speculative decoding (`kiln make-draft-model`): draft_distill.py distils a
draft model, eagle_training.py trains an EAGLE head (eagle_head.py) on the target's pass over the
corpus (teacher.py); loop_helpers.py is what they share. Offline tooling: the serving engine never
imports it."""
