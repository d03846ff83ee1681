"""Tokenizer internals: backends (HF ``tokenizer.json``, SentencePiece), ChatML rendering, SentencePiece training.

The public entry point is :mod:`comprl_jax.tokenizer`; import from there.
"""
