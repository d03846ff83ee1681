"""Quick reads of a model's skills during its supervised run: replies sampled at temperature 1 (the run's) for a fixed
set of held-out prompts, without the run's constrained decoding or KV cache (a full forward per new token: a few
seconds for a few hundred short prompts). What the warm-start trainer logs and how it picks the early extractor;
the skills that count are measured by play through the run's own sampler (:mod:`comprl_jax.warm.skills`)."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from comprl_jax.envs.base import parse_answer
from comprl_jax.experience.ops import parse_ops
from comprl_jax.models import decoder as dec
from comprl_jax.warm import corpus as C


def sample_replies(graphdef, params, prompts, tok, max_new: int, key, temperature: float = 1.0) -> list[str]:
    """Each prompt's continuation (ids after it, up to ``<|im_end|>`` or ``max_new`` tokens) as text."""
    B = len(prompts)
    L = max(len(p) for p in prompts) + max_new
    L = -(-L // 16) * 16
    toks = np.full((B, L), tok.pad_id, np.int32)
    lens = np.array([len(p) for p in prompts])
    for b, p in enumerate(prompts):
        toks[b, : len(p)] = p
    start = lens.copy()
    done = np.zeros(B, bool)
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))

    @jax.jit
    def step(params, toks, lens, key):
        valid = jnp.arange(L)[None, :] < lens[:, None]
        logits = dec.forward(graphdef, params, toks, positions, valid)
        last = jnp.take_along_axis(logits, (lens - 1)[:, None, None], axis=1)[:, 0]
        return jax.random.categorical(key, last / temperature)

    for i in range(max_new):
        nxt = np.asarray(step(params, jnp.asarray(toks), jnp.asarray(lens), jax.random.fold_in(key, i)))
        live = ~done
        toks[np.arange(B)[live], lens[live]] = nxt[live]
        lens[live] += 1
        done |= nxt == tok.eos_id
        if done.all():
            break
    return [tok.decode(toks[b, start[b] : lens[b]].tolist(), skip_special=True) for b in range(B)]


class ActorProbe:
    """Sampled answers to held-out actor prompts (attempts=1 and 3), per kind: ``follow`` (the applying lesson's
    verb played), ``copy_other`` (a verb another family's lesson claims played; chance = claimed / 8),
    ``play_failed`` (a verb its own family's lesson says failed), ``stale_play`` (a verb already failed in the
    episode), ``none_top`` (the most frequent action's share with no lesson; 0.125 = uniform)."""

    def __init__(self, held, tok, model_cfg, n: int = 300, seed: int = 0):
        self.held, self.tok = list(held)[:n], tok
        self.prompts = [a.ids(tok)[0] for a in self.held]
        self.graphdef = dec.abstract_decoder(model_cfg)[0]
        self.key = jax.random.key(seed)

    def __call__(self, step, params) -> dict:
        outs = sample_replies(self.graphdef, params, self.prompts, self.tok, 48, self.key)
        got = collections.defaultdict(list)
        none = collections.Counter()
        for a, text in zip(self.held, outs, strict=True):
            played = parse_answer(text)
            got["valid"].append(played in C.VERBS)
            if a.kind == "follow":
                got["follow"].append(played == a.target)
            elif a.kind == "other":
                claimed = {x.verbs[0] for x in a.entries if x.works}
                got["copy_other"].append(played in claimed)
            elif a.kind == "avoid":
                got["play_failed"].append(
                    played in {v for x in a.entries if x.family == a.family for v in x.verbs}
                )
            elif a.kind == "stale":
                got["stale_play"].append(played in a.history)
            elif a.kind == "none":
                none[played] += 1
        out = {k: round(float(np.mean(v)), 4) for k, v in sorted(got.items())}
        if none:
            out["none_top"] = round(max(none.values()) / sum(none.values()), 4)
        return out


class ExtractorProbe:
    """Sampled distillations of held-out successful episodes: the share whose lesson names the episode's family and
    claims the verb that opened it (``right_after_success``, :func:`corpus.lesson_is_right`)."""

    def __init__(self, held, tok, ex_args, model_cfg, n: int = 200, seed: int = 0):
        self.held = [e for e in held if e.success][:n]
        self.tok, self.max_chars = tok, ex_args[0]
        self.prompts = [e.ids(tok, *ex_args)[0] for e in self.held]
        self.graphdef = dec.abstract_decoder(model_cfg)[0]
        self.key = jax.random.key(seed)

    def __call__(self, step, params) -> dict:
        outs = sample_replies(self.graphdef, params, self.prompts, self.tok, 64, self.key)
        right = []
        for e, text in zip(self.held, outs, strict=True):
            cut = text.find("</answer>")  # the run's extractor call stops at this stop string
            text = text[: cut + len("</answer>")] if cut >= 0 else text
            ops = parse_ops(text, len(e.previous), self.max_chars).ops
            right.append(any(C.lesson_is_right(op.new_memory, e.family, e.rule) for op in ops))
        return {"right_after_success": round(float(np.mean(right)), 4)}
