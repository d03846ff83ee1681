"""The warm actor's decision token, teacher-forced (issue 49): one JSON line, ``bench: "warm_decision"``.

  python launch/bench/warm_decision.py [--model=warm_actor] [--examples=400] [--corpus_seed=7] [--attention_examples=30]

The actor's think restates the entry about its own family, or the family's name alone; the token after the name
decides which (``:`` and the entry, or ``</think>``). Over corpus prompts (training place names, and held-out ones),
this prints the mean probability the actor gives the right token there, by whether an entry about the own family is
in the block (``own`` / ``absent``) and the block's size (``n-1``: no block, ``n0``: an empty one, ``n1``-``n3``:
entries), with the count behind each; for blocks of 2-3 entries also by where the own entry sits (``own_n3_at1``:
second of three) and by whether a distractor shares a word of the family's name (``own_n2_near1``). At the base rate of the corpus (74% of prompts with entries hold an entry
about the own family) an actor that does not match titles against the observation gives ~0.74 to ``:`` whatever the
block says: ``own`` and ``absent`` near 1 each is the skill (WORKSPACE, issue 49).

``--attention_examples=N`` also prints where the actor looks when it decides (``bench: "warm_attention"``).
Matching the name against the entries' titles is an induction step: a head at the name's position should attend to
the own entry's title (or to the ``:`` piece after it) and not to the other entries' titles. Over N held-out prompts
per block size ``n`` (1-3) whose block holds an entry about the own family, it prints for every layer ``L`` and head
``h`` the mean attention at the name's position on the own title token (``own``), on the piece after it
(``own_next``), and per other entry on its title (``other``) and the piece after it (``other_next``), with
``p_right``, the decision's probability. A head that matches has ``own`` (or ``own_next``) well above ``other``
(``other_next``). The decoder returns no attention weights: within this process the probe wraps its attention
function (``decoder._causal_self_attention``) to recompute the softmax from the same q and k, unjitted (~8 s a
prompt on 2 cores).
"""

from __future__ import annotations

import collections
import json
import os
import sys
from unittest import mock

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def define_flags() -> None:
    """The command line (only as a script: a test loads this module beside other launch scripts)."""
    flags.DEFINE_string("model", "warm_actor", "the actor: a warm preset name or a Hugging Face folder")
    flags.DEFINE_integer("examples", 400, "corpus prompts per split")
    flags.DEFINE_integer("corpus_seed", 7, "the corpus seed of the probe prompts")
    flags.DEFINE_integer(
        "attention_examples", 0, "also the attention line: held-out prompts per block size (0: not measured)"
    )


def measure(model: str, n: int, seed: int) -> dict:
    import jax
    import jax.numpy as jnp

    from comprl_jax.models.zoo import load_model
    from comprl_jax.warm import corpus as C
    from comprl_jax.warm import sft

    m = load_model(model, role="actor", tokenizer=None, seed=0)
    tok = m.tokenizer
    fwd = jax.jit(sft.answer_logits, static_argnums=0)
    out = {"bench": "warm_decision", "model": model, "corpus_seed": seed}
    for split, held_out in (("train", False), ("held_out", True)):
        ex = C.examples("actor", seed, n, held_out=held_out)
        rows = [a.ids(tok) for a in ex]
        got = collections.defaultdict(list)
        for i in range(0, len(rows), 100):
            chunk = rows[i : i + 100]
            arr = sft.pack(chunk, tok.pad_id, 40, size=100)
            logits = np.asarray(fwd(m.graphdef, m.params, *map(jnp.asarray, arr[:3])), np.float64)
            for b, a in enumerate(ex[i : i + 100]):
                k = a.decision_index(tok, chunk[b][1])
                row = logits[b, k]
                p = np.exp(row - row.max())
                size = -1 if a.entries is None else len(a.entries)
                side = "own" if a.think != a.family else "absent"
                right = float(p[arr[3][b, k]] / p.sum())
                got[f"{side}_n{size}"].append(right)
                if side == "own" and size > 1:  # where the own entry sits: a dilution misses at every place
                    at = next(j for j, e in enumerate(a.entries) if e.family == a.family)
                    got[f"own_n{size}_at{at}"].append(right)
                    # a distractor shares a word of the name
                    words = set(a.family.split(" "))
                    near = any(e.family != a.family and words & set(e.family.split(" ")) for e in a.entries)
                    got[f"own_n{size}_near{int(near)}"].append(right)
        for key, vals in sorted(got.items()):
            out[f"{split}_{key}"] = round(float(np.mean(vals)), 4)
            out[f"{split}_{key}_count"] = len(vals)
    return out


def attention(model: str, per_size: int, seed: int) -> dict:
    """The ``warm_attention`` line (module docstring)."""
    import jax
    import jax.numpy as jnp

    from comprl_jax.models import decoder as dec
    from comprl_jax.models.zoo import load_model
    from comprl_jax.warm import corpus as C

    m = load_model(model, role="actor", tokenizer=None, seed=0)
    tok = m.tokenizer
    seen: list[np.ndarray] = []  # per layer: the softmax [B, H, T, T]
    attend = dec._causal_self_attention

    def recording(cfg, q, k, v, valid, segment_ids=None):
        kk = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(q.shape[-1])
        t = q.shape[1]
        ok = jnp.tril(jnp.ones((t, t), bool))[None, None] & valid[:, None, None, :]
        w = jax.nn.softmax(jnp.where(ok, s, -1e30), -1)
        jax.debug.callback(lambda w_: seen.append(np.asarray(w_)), w)  # layers run under a scan
        return attend(cfg, q, k, v, valid, segment_ids)

    families = {tok.encode(f)[0] for f in C.FAMILIES}
    pool = [
        a
        for a in C.examples("actor", seed, 40 * per_size, held_out=True)
        if a.entries and a.think != a.family
    ]
    agg = collections.defaultdict(list)
    with mock.patch.object(dec, "_causal_self_attention", recording):
        for n in (1, 2, 3):
            for a in [a for a in pool if len(a.entries) == n][:per_size]:
                prompt, target = a.ids(tok)
                d = a.decision_index(tok, target)
                seq = prompt + target[:d]
                q = len(seq) - 1  # the name's last token: its logits are the decision's
                seen.clear()
                toks = jnp.asarray([seq], jnp.int32)
                pos = jnp.arange(len(seq), dtype=jnp.int32)[None]
                logits = dec.forward(m.graphdef, m.params, toks, pos, jnp.ones_like(toks, bool))
                jax.effects_barrier()
                agg[f"n{n}_p_right"].append(float(jax.nn.softmax(logits[0, q])[target[d]]))
                own_id = tok.encode(a.family)[0]
                titles = [
                    i for i in range(len(seq) - 1)
                    if seq[i] in families and tok.decode([seq[i + 1]]).startswith(":")
                ]  # fmt: skip
                own = [i for i in titles if seq[i] == own_id]
                other = [i for i in titles if seq[i] != own_id]
                for layer, w in enumerate(seen):
                    for h in range(w.shape[1]):
                        row = w[0, h, q]
                        agg[f"n{n}_L{layer}h{h}_own"].append(row[own].sum())
                        agg[f"n{n}_L{layer}h{h}_own_next"].append(row[[i + 1 for i in own]].sum())
                        if other:
                            agg[f"n{n}_L{layer}h{h}_other"].append(row[other].mean())
                            agg[f"n{n}_L{layer}h{h}_other_next"].append(row[[i + 1 for i in other]].mean())
    out = {"bench": "warm_attention", "model": model, "corpus_seed": seed}
    for key, vals in sorted(agg.items()):
        out[key] = round(float(np.mean(vals)), 4)
        if key.endswith("_p_right"):
            out[key.removesuffix("_p_right") + "_count"] = len(vals)
    return out


def main(argv):
    del argv
    F = flags.FLAGS
    print(json.dumps(measure(F.model, F.examples, F.corpus_seed)))
    if F.attention_examples:
        print(json.dumps(attention(F.model, F.attention_examples, F.corpus_seed)))


if __name__ == "__main__":
    define_flags()
    app.run(main)
