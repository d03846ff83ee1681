"""Building blocks of the generation engine; the public entry point is :mod:`comprl_jax.sampling`.

* :mod:`.automaton` -- constrained decoding: a token automaton (allowed-token mask + transition table) built from a
  list of allowed strings (trie) or a regular expression (``outlines-core``).
* :mod:`.stops` -- on-device stop-string detection (an Aho-Corasick automaton lifted to whole tokens).
* :mod:`.filters` -- temperature / top-k / top-p / greedy, with logprobs under the unmodified distribution.
* :mod:`.decode` -- the jitted prefill + ``lax.while_loop`` decode.
"""
