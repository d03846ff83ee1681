"""Where the warm actor looks when it decides (issue 49): one JSON line, ``bench: "warm_attention"``.

  python launch/bench/warm_attention.py [--model=warm_actor] [--examples=30] [--corpus_seed=7]

The actor's think writes its family's name; the token after it says whether an entry about that family is in the
block (``: …`` and the entry, or ``</think>``; ``launch/bench/warm_decision.py``). Matching the name against the
entries' titles is an induction step: a head at the name's position should attend to the own entry's title (or to
the ``:`` piece after it) and not to the other entries' titles. Over held-out corpus prompts whose block holds an
entry about the own family, by block size ``n`` (1-3), this prints for every layer ``L`` and head ``h`` the mean
attention at the name's position on the own title token (``own``), on the piece after it (``own_next``), and per
other entry on its title (``other``) and the piece after it (``other_next``), with ``p_right``, the decision's
probability. A head that matches has ``own`` (or ``own_next``) well above ``other`` (``other_next``).

The decoder returns no attention weights: within this process the probe wraps its attention function
(``decoder._causal_self_attention``) to recompute the softmax from the same q and k, unjitted; nothing else runs.
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
    """The command line (only as a script)."""
    flags.DEFINE_string("model", "warm_actor", "the actor: a warm preset name or a Hugging Face folder")
    flags.DEFINE_integer(
        "examples", 30, "held-out corpus prompts (with an entry about the own family) per block size"
    )
    flags.DEFINE_integer("corpus_seed", 7, "the corpus seed of the probe prompts")


def measure(model: str, per_size: int, seed: int) -> dict:
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
                agg[(n, "p_right")].append(float(jax.nn.softmax(logits[0, q])[target[d]]))
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
                        agg[(n, layer, h, "own")].append(row[own].sum())
                        agg[(n, layer, h, "own_next")].append(row[[i + 1 for i in own]].sum())
                        if other:
                            agg[(n, layer, h, "other")].append(row[other].mean())
                            agg[(n, layer, h, "other_next")].append(row[[i + 1 for i in other]].mean())
    out = {"bench": "warm_attention", "model": model, "corpus_seed": seed}
    for key, vals in sorted(agg.items(), key=lambda kv: str(kv[0])):
        name = f"n{key[0]}_p_right" if key[1] == "p_right" else f"n{key[0]}_L{key[1]}h{key[2]}_{key[3]}"
        out[name] = round(float(np.mean(vals)), 4)
        if key[1] == "p_right":
            out[f"n{key[0]}_count"] = len(vals)
    return out


def main(argv):
    del argv
    F = flags.FLAGS
    print(json.dumps(measure(F.model, F.examples, F.corpus_seed)))


if __name__ == "__main__":
    define_flags()
    app.run(main)
