"""The warm actor's decision token, teacher-forced (issue 49): one JSON line, ``bench: "warm_decision"``.

  python launch/bench/warm_decision.py [--model=warm_actor] [--examples=400] [--corpus_seed=7]

The actor's think restates the entry about its own family, or the family's name alone; the token after the name
decides which (``:`` and the entry, or ``</think>``). Over corpus prompts (training place names, and held-out ones),
this prints the mean probability the actor gives the right token there, by whether an entry about the own family is
in the block (``own`` / ``absent``) and the block's size (``n-1``: no block, ``n0``: an empty one, ``n1``-``n3``:
entries), with the count behind each; for blocks of 2-3 entries also by where the own entry sits (``own_n3_at1``:
second of three) and by whether a distractor shares a word of the family's name (``own_n2_near1``). At the base rate of the corpus (74% of prompts with entries hold an entry
about the own family) an actor that does not match titles against the observation gives ~0.74 to ``:`` whatever the
block says: ``own`` and ``absent`` near 1 each is the skill (WORKSPACE, issue 49).
"""

from __future__ import annotations

import collections
import json
import os
import sys

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def define_flags() -> None:
    """The command line (only as a script: a test loads this module beside other launch scripts)."""
    flags.DEFINE_string("model", "warm_actor", "the actor: a warm preset name or a Hugging Face folder")
    flags.DEFINE_integer("examples", 400, "corpus prompts per split")
    flags.DEFINE_integer("corpus_seed", 7, "the corpus seed of the probe prompts")


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
                    colour, kind = a.family.split(" ")
                    near = any(
                        e.family != a.family and (colour in e.family or kind in e.family) for e in a.entries
                    )
                    got[f"own_n{size}_near{int(near)}"].append(
                        right
                    )  # a distractor shares a word of the name
        for key, vals in sorted(got.items()):
            out[f"{split}_{key}"] = round(float(np.mean(vals)), 4)
            out[f"{split}_{key}_count"] = len(vals)
    return out


def main(argv):
    del argv
    F = flags.FLAGS
    print(json.dumps(measure(F.model, F.examples, F.corpus_seed)))


if __name__ == "__main__":
    define_flags()
    app.run(main)
