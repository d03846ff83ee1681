"""Generation engine: jitted KV-cache sampling with stop strings, logprobs, constraints and multi-turn continuation.

Public API::

    svc = SamplerService(graphdef, params, cfg, vocab=vocab_bytes(tok, cfg.vocab_size),
                         stop_token_ids=(tok.eos_id, tok.special_ids["<|im_end|>"]), pad_id=tok.pad_id, mesh=None)
    res = svc.generate(prompts, key, SamplingParams(max_new_tokens=64, temperature=0.99, top_p=0.99),
                       stop_strings=("</answer>",), constraint=svc.regex_constraint(r"<answer>(north|south)</answer>"))
    res.tokens [B, N], res.lengths [B], res.finish_reason [B] (0 stop / 1 length), res.logprobs [B, N]  (numpy)
    svc.actions_constraint(("north", "southeast"))         # <answer>{action}</answer>, south-east / south east too

    conv = svc.conversation(batch=B, max_len=4096)        # multi-turn, token in / token out
    r1 = conv.turn(first_prompts, key1, sp)               # prefill + generate
    r2 = conv.turn(observation_tokens, key2, sp)          # appended to the live cache (incremental prefill)
    ids, assistant_mask = conv.tokens(b)                  # exactly the sampled ids; mask 1 on generated tokens
    old_logprobs = conv.logprobs(b)                       # sampling-time logprobs aligned with ids (0 off-mask)

Each call is one jitted function (:func:`comprl_jax.sampling.decode.decode`): prefill through the model's
``extend`` then a ``lax.while_loop`` decode that ends when every row is done. Shapes are bucketed (batch and
input length to powers of two, ``max_new_tokens`` as given, the cache length per conversation) so a run compiles
once per bucket. Logprobs are under the unmodified model distribution. Stop strings: see
:mod:`comprl_jax.sampling.stops` for exactly where detection can miss.

Threading contract: a :class:`SamplerService` owns one model's graphdef/params and a lock; any thread may call
:meth:`SamplerService.generate` / :meth:`Conversation.turn`; calls on one service are serialised by its lock
(dispatch + the blocking host copy), so the extractor's service can run in a background thread while the main
thread drives the actor's service. :meth:`SamplerService.update_params` swaps weights under the same lock (the
next call sees the new weights; a running call finishes with the old ones). A :class:`Conversation` itself is
not thread-safe: one thread per conversation.

Modules of the package (this ``__init__`` only re-exports): :mod:`.service` (:class:`SamplerService`,
:class:`Conversation`), :mod:`.automaton` (constrained decoding: a token automaton, allowed-token mask +
transition table, from a list of allowed strings or a regular expression via ``outlines-core``), :mod:`.stops`
(on-device stop-string detection, an Aho-Corasick automaton lifted to whole tokens), :mod:`.filters`
(temperature / top-k / top-p / greedy, logprobs under the unmodified distribution), :mod:`.decode` (the jitted
prefill + ``lax.while_loop`` decode).

Under a mesh the batch is sharded over ``("data", "fsdp")`` (the ``batch`` logical axis) and the cache likewise;
weights keep the shardings they were created with.
"""

from comprl_jax.sampling.automaton import (
    TokenAutomaton,
    accepts,
    action_spellings,
    either,
    from_actions,
    from_regex,
    from_strings,
    from_token_sequences,
    vocab_bytes,
)
from comprl_jax.sampling.decode import FINISH_LENGTH, FINISH_STOP, GenerationResult, decode, row_keys
from comprl_jax.sampling.filters import SamplingParams, filter_logits, select_tokens
from comprl_jax.sampling.service import (
    MIN_CACHE_SLOTS,
    PREFILL_TOKENS,
    Conversation,
    SamplerService,
    bucket,
    cache_shardings,
    prefill_groups,
)
from comprl_jax.sampling.stops import StopAutomaton, build_stop_automaton, find_stop

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "MIN_CACHE_SLOTS",
    "PREFILL_TOKENS",
    "Conversation",
    "GenerationResult",
    "SamplerService",
    "SamplingParams",
    "StopAutomaton",
    "TokenAutomaton",
    "accepts",
    "action_spellings",
    "bucket",
    "build_stop_automaton",
    "cache_shardings",
    "decode",
    "either",
    "filter_logits",
    "find_stop",
    "from_actions",
    "from_regex",
    "from_strings",
    "from_token_sequences",
    "prefill_groups",
    "row_keys",
    "select_tokens",
    "vocab_bytes",
]
