"""Constrained decoding: a token automaton applied inside the decode loop.

A :class:`TokenAutomaton` is two dense tables over the model vocabulary, indexed by an automaton state ``s``:

* ``allowed[s, t]`` -- may token ``t`` be emitted in state ``s``;
* ``next_state[s, t]`` -- the state after emitting ``t`` (only meaningful where allowed);

plus ``accept[s]`` (the text so far is a complete match). State 0 is the initial state. At an accepting state the
stop token ids (EOS / end-of-turn) are allowed too, so the model can end the reply there; a string that is a
prefix of a longer allowed one (``"go"`` / ``"go north"``) lets the model choose.

Dead states (no way to reach an accepting state with the vocabulary's tokens) are pruned, so *every reachable
state allows at least one token*: the masked softmax is never all ``-inf`` (tested). Special tokens (``b""``
bytes) are never allowed except the stop ids at accepting states.

A static action set goes through :func:`from_actions`: every action in every natural spelling
(:func:`action_spellings`: ``south-east`` / ``south east`` next to ``southeast``), each in any tokenization. A small
pretrained model copies a compound only in its whole-word spelling (SmolLM2 writes ``south`` ``-`` ``east``; the
name's own BPE path ``s`` ``outheast`` it rarely starts), so the plain name alone hid the diagonals from it.

Builders work on ``vocab: Sequence[bytes]``: the exact bytes each token id contributes to decoded text
(``Tokenizer.token_bytes``), ``b""`` for special/unused ids, padded to the model's vocabulary size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import flax.struct
import jax
import numpy as np


@flax.struct.dataclass
class TokenAutomaton:
    """Device-side token automaton; a pytree, passed into the jitted decode as an argument.

    Attributes:
      allowed: ``[S, V]`` bool.
      next_state: ``[S, V]`` int32 (self-loop where not allowed).
      accept: ``[S]`` bool.
    """

    allowed: jax.Array
    next_state: jax.Array
    accept: jax.Array

    @property
    def num_states(self) -> int:
        return int(self.allowed.shape[0])


def vocab_bytes(tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """``[tokenizer.token_bytes(i) for i]``, padded with ``b""`` up to ``vocab_size`` (the model's, often larger)."""
    n = int(tokenizer.vocab_size)
    out = [bytes(tokenizer.token_bytes(i)) for i in range(n)]
    if vocab_size is not None:
        if vocab_size < n:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {n}")
        out += [b""] * (vocab_size - n)
    return out


# ----------------------------------------------------------------------------------------------------------
# Sparse form shared by the builders: trans[state] = {token: next_state}, a set of accepting states, initial.
# ----------------------------------------------------------------------------------------------------------


def _finalize(
    trans: dict[int, dict[int, int]],
    accept: set[int],
    initial: int,
    vocab_size: int,
    stop_ids: Iterable[int],
    what: str,
) -> TokenAutomaton:
    """Prunes dead / unreachable states, renumbers (initial -> 0) and builds the dense tables."""
    stop_ids = sorted({int(i) for i in stop_ids})
    if not stop_ids:
        raise ValueError(f"{what}: at least one stop token id (EOS / end-of-turn) is needed to end a match")
    bad = [i for i in stop_ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{what}: stop token ids {bad} are outside the vocabulary [0, {vocab_size})")
    # Live = can reach an accepting state (backward BFS over the token transitions).
    states = set(trans) | accept | {initial} | {n for d in trans.values() for n in d.values()}
    preds: dict[int, set[int]] = {s: set() for s in states}
    for s, d in trans.items():
        for n in d.values():
            preds[n].add(s)
    live = set(accept)
    queue = deque(accept)
    while queue:
        for p in preds[queue.popleft()]:
            if p not in live:
                live.add(p)
                queue.append(p)
    if initial not in live:
        raise ValueError(f"{what}: no allowed string can be spelled with this vocabulary's tokens")
    # Reachable from the initial state through live states only; BFS order gives initial -> 0.
    order = {initial: 0}
    queue = deque([initial])
    while queue:
        s = queue.popleft()
        for n in trans.get(s, {}).values():
            if n in live and n not in order:
                order[n] = len(order)
                queue.append(n)
    S = len(order)
    allowed = np.zeros((S, vocab_size), bool)
    next_state = np.tile(np.arange(S, dtype=np.int32)[:, None], (1, vocab_size))
    acc = np.zeros((S,), bool)
    for s, i in order.items():
        for t, n in trans.get(s, {}).items():
            if n in order:  # transitions into dead states are dropped (that is the pruning)
                allowed[i, t] = True
                next_state[i, t] = order[n]
        if s in accept:
            acc[i] = True
            allowed[i, stop_ids] = True  # ending here is fine; the row stops, next_state is irrelevant
    assert allowed.any(axis=1).all(), "internal: a live state masks every token"
    return TokenAutomaton(allowed=allowed, next_state=next_state, accept=acc)


def from_strings(
    strings: Sequence[str | bytes], vocab: Sequence[bytes], stop_ids: Iterable[int]
) -> TokenAutomaton:
    """Automaton whose accepted texts are exactly ``strings`` (e.g. the action set, ``"<answer>north</answer>"``).

    States are the nodes of a byte trie over ``strings``; token ``t`` is allowed in node ``s`` iff its bytes
    continue a path of the trie (walked jointly with a byte trie of the vocabulary, so the cost is the size of
    the intersection, not ``S * V``). Any tokenization of an allowed string is reachable.

    Args:
      strings: the allowed texts (str are UTF-8 encoded). Empty strings are rejected.
      vocab: ``[V]`` bytes of each token id (``b""`` = special, never allowed).
      stop_ids: token ids that end a reply (EOS / end-of-turn); allowed at accepting states only.
    """
    enc = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in strings]
    if not enc or any(not s for s in enc):
        raise ValueError(f"from_strings needs non-empty strings, got {list(strings)!r}")
    # Byte trie over the allowed strings: node -> {byte: child}.
    children: list[dict[int, int]] = [{}]
    accept: set[int] = set()
    for s in enc:
        node = 0
        for b in s:
            nxt = children[node].get(b)
            if nxt is None:
                nxt = len(children)
                children[node][b] = nxt
                children.append({})
            node = nxt
        accept.add(node)
    # Byte trie over the vocabulary: (children, ids ending here).
    stop_set = {int(i) for i in stop_ids}
    vroot: tuple[dict, list] = ({}, [])
    for tid, tb in enumerate(vocab):
        if not tb or tid in stop_set:
            continue
        node = vroot
        for b in tb:
            node = node[0].setdefault(b, ({}, []))
        node[1].append(tid)
    trans: dict[int, dict[int, int]] = {}
    for s in range(len(children)):
        out: dict[int, int] = {}
        stack = [(vroot, s)]
        while stack:
            vnode, snode = stack.pop()
            vkids, skids = vnode[0], children[snode]
            small, other = (vkids, skids) if len(vkids) < len(skids) else (skids, vkids)
            for b in small:
                if b in other:
                    vchild, schild = vkids[b], skids[b]
                    for tid in vchild[1]:
                        out[tid] = schild
                    stack.append((vchild, schild))
        if out:
            trans[s] = out
    return _finalize(trans, accept, 0, len(vocab), stop_set, f"from_strings({list(strings)[:4]!r}...)")


def action_spellings(actions: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each action with the spellings a pretrained model writes for it: itself, and for an action that joins two
    others (``"southeast"`` = ``"south"`` + ``"east"``) the split forms ``"south-east"`` and ``"south east"``.

    Why: a byte-level BPE spells a rare compound with an odd token path (SmolLM2: ``"southeast"`` is ``s`` +
    ``outheast``), which a small model does not copy from its prompt: asked for "southeast" it starts with the
    token ``south`` and then closes the answer (measured in ``tests/test_smollm.py``). The split forms are whole-word
    tokens (``south`` ``-`` ``east``). The caller's env must map every spelling to its action (MiniHack's
    ``normalize_action`` strips punctuation and knows "south east").

    Args:
      actions: the action names. Returns: ``{action: (spellings...)}``, the action itself first, in input order.
    """
    names = [str(a) for a in actions]
    known = set(names)
    out: dict[str, tuple[str, ...]] = {}
    for a in names:
        spell = [a]
        for head in names:
            tail = a[len(head) :]
            if head != a and a.startswith(head) and tail in known:
                spell += [f"{head}-{tail}", f"{head} {tail}"]
        out[a] = tuple(dict.fromkeys(spell))
    return out


def from_actions(
    actions: Sequence[str],
    vocab: Sequence[bytes],
    stop_ids: Iterable[int],
    template: str = "<answer>{}</answer>",
) -> TokenAutomaton:
    """:func:`from_strings` over ``template.format(s)`` for every spelling ``s`` of every action
    (:func:`action_spellings`): the constraint of a static action set that leaves the model its natural spelling.

    Args:
      actions: the action names. vocab: ``[V]`` token bytes. stop_ids: ids that end a reply.
      template: the reply format with one ``{}`` for the action.
    """
    texts = [template.format(s) for spell in action_spellings(actions).values() for s in spell]
    return from_strings(texts, vocab, stop_ids)


def from_token_sequences(
    sequences: Sequence[Sequence[int]], vocab_size: int, stop_ids: Iterable[int]
) -> TokenAutomaton:
    """Automaton accepting exactly the token-id ``sequences`` (one path each: no other tokenization of the same
    text), e.g. each action's canonical tokenization.

    Why: under :func:`from_strings` every tokenization of an allowed text is a path, so a model with no preference
    (a random-init one) splits its mass by the number and shape of the paths, not by the actions: with the tiny
    vocabulary ``east`` got 26% of the first moves and ``south`` 3%. With one path per action, and each action one
    token (the tiny vocabulary makes action names atomic, :func:`comprl_jax.models.zoo.tiny_tokenizer`), such a model
    starts uniform over the actions.

    Args:
      sequences: non-empty token-id lists; vocab_size: ``V``; stop_ids: ids allowed at accepting states.
    """
    if not sequences or any(len(q) == 0 for q in sequences):
        raise ValueError("from_token_sequences needs non-empty token sequences")
    trans: dict[int, dict[int, int]] = {}
    accept: set[int] = set()
    count = 1
    for q in sequences:
        node = 0
        for t in q:
            if not 0 <= int(t) < vocab_size:
                raise ValueError(
                    f"from_token_sequences: token id {t} is outside the vocabulary [0, {vocab_size})"
                )
            nxt = trans.setdefault(node, {}).get(int(t))
            if nxt is None:
                nxt = trans[node][int(t)] = count
                count += 1
            node = nxt
        accept.add(node)
    return _finalize(trans, accept, 0, vocab_size, stop_ids, "from_token_sequences")


def either(a: TokenAutomaton, b: TokenAutomaton) -> TokenAutomaton:
    """An automaton accepting what ``a`` or ``b`` accepts (product of the two, only the reachable pairs).

    A token allowed by both moves both; one allowed by one only leaves the other behind. Used to add the search &
    ask tag (a regex) beside canonical action paths (:func:`from_token_sequences`).
    """
    aa, an, ac = (np.asarray(x) for x in (a.allowed, a.next_state, a.accept))
    ba, bn, bc = (np.asarray(x) for x in (b.allowed, b.next_state, b.accept))
    if aa.shape[1] != ba.shape[1]:
        raise ValueError(f"automata over different vocabularies ({aa.shape[1]} and {ba.shape[1]} tokens)")
    dead = -1
    order = {(0, 0): 0}
    queue = deque([(0, 0)])
    rows_allowed, rows_next, rows_accept = [], [], []
    while queue:
        sa, sb = queue.popleft()
        in_a = aa[sa] if sa != dead else np.zeros(aa.shape[1], bool)
        in_b = ba[sb] if sb != dead else np.zeros(ba.shape[1], bool)
        ok = in_a | in_b
        nxt = np.zeros(aa.shape[1], np.int32)
        for t in np.flatnonzero(ok):
            pair = (int(an[sa, t]) if in_a[t] else dead, int(bn[sb, t]) if in_b[t] else dead)
            if pair not in order:
                order[pair] = len(order)
                queue.append(pair)
            nxt[t] = order[pair]
        rows_allowed.append(ok)
        rows_next.append(nxt)
        rows_accept.append(bool((sa != dead and ac[sa]) or (sb != dead and bc[sb])))
    # A stop token ends the row wherever it is allowed, so its (self-looping) next state is never used.
    idx = np.arange(len(rows_next), dtype=np.int32)[:, None]
    allowed = np.stack(rows_allowed)
    return TokenAutomaton(
        allowed=allowed,
        next_state=np.where(allowed, np.stack(rows_next), idx).astype(np.int32),
        accept=np.asarray(rows_accept, bool),
    )


def from_regex(pattern: str, vocab: Sequence[bytes], stop_ids: Iterable[int]) -> TokenAutomaton:
    """Automaton for a regular expression (full match), compiled by PyPI ``outlines-core`` (``Index``).

    Args:
      pattern: regex in the ``regex-automata`` (Rust) dialect, e.g. ``r"<answer>(north|south)</answer>"``.
      vocab: ``[V]`` bytes of each token id (``b""`` = special, never allowed).
      stop_ids: token ids that end a reply; allowed at the regex's final states only.
    """
    from outlines_core import Index, Vocabulary  # imported lazily: only constrained runs need it

    stop_ids = sorted({int(i) for i in stop_ids})
    if not stop_ids:
        raise ValueError(f"from_regex({pattern!r}): at least one stop token id is needed")
    by_bytes: dict[bytes, list[int]] = {}
    for tid, tb in enumerate(vocab):
        if tb and tid not in stop_ids:
            by_bytes.setdefault(bytes(tb), []).append(tid)
    # outlines-core wants one EOS id outside the map; it adds EOS self-loops at final states, which we drop
    # (our stop ids are added at accepting states by _finalize).
    try:
        index = Index(pattern, Vocabulary(stop_ids[0], by_bytes))
    except Exception as e:  # outlines raises ValueError/RuntimeError variants; name the pattern either way
        raise ValueError(f"from_regex: cannot compile {pattern!r} over this vocabulary: {e}") from e
    trans = {
        int(s): {int(t): int(n) for t, n in d.items() if int(t) not in stop_ids}
        for s, d in index.get_transitions().items()
    }
    accept = {int(s) for s in index.get_final_states()}
    return _finalize(
        trans, accept, int(index.get_initial_state()), len(vocab), stop_ids, f"from_regex({pattern!r})"
    )


def accepts(automaton: TokenAutomaton, tokens: Sequence[int]) -> bool:
    """Host-side check: does the token sequence (without the final stop id) end in an accepting state?"""
    allowed, nxt = np.asarray(automaton.allowed), np.asarray(automaton.next_state)
    s = 0
    for t in tokens:
        if not allowed[s, t]:
            return False
        s = int(nxt[s, t])
    return bool(np.asarray(automaton.accept)[s])


def union(automata: Sequence[TokenAutomaton | None]) -> tuple[TokenAutomaton | None, tuple[int, ...]]:
    """One automaton holding every one of ``automata`` (state tables stacked, each one's transitions offset to its
    own block), and the start state of each: rows under different constraints then decode in one batch, each
    starting in its own block's state. ``None`` (unconstrained) becomes one state that allows every token.

    Returns:
      ``(automaton, starts)``; ``(None, (0, ...))`` when every entry is ``None``.
    """
    real = [a for a in automata if a is not None]
    if not real:
        return None, (0,) * len(automata)
    V = int(real[0].allowed.shape[1])
    allowed, nxt, acc, starts = [], [], [], []
    offset = 0
    for a in automata:
        if a is None:
            a = TokenAutomaton(
                allowed=np.ones((1, V), bool),
                next_state=np.zeros((1, V), np.int32),
                accept=np.ones((1,), bool),
            )
        if int(a.allowed.shape[1]) != V:
            raise ValueError(
                f"automata over different vocabularies ({V} and {int(a.allowed.shape[1])} tokens)"
            )
        allowed.append(np.asarray(a.allowed))
        nxt.append(np.asarray(a.next_state) + offset)
        acc.append(np.asarray(a.accept))
        starts.append(offset)
        offset += int(a.allowed.shape[0])
    return (
        TokenAutomaton(
            allowed=np.concatenate(allowed),
            next_state=np.concatenate(nxt).astype(np.int32),
            accept=np.concatenate(acc),
        ),
        tuple(starts),
    )
