"""The training loop: one step of SPEC §6 (trainer), the extractor's side of it, evaluation."""
