"""Quick reads of a model's skills during its supervised run (teacher forcing, no sampling): what the warm-start
trainer logs and how it picks the early extractor. The skills that count are measured by play
(:mod:`comprl_jax.warm.skills`, launch/bench/warm_start.py)."""

from __future__ import annotations

import collections

import jax
import numpy as np

from comprl_jax.models import decoder as dec
from comprl_jax.warm import corpus as C
from comprl_jax.warm import sft


def _verb_probs(logits: np.ndarray, verb_ids: np.ndarray) -> np.ndarray:
    """Softmax over the 8 actions only (the run's constrained decoding chooses among them)."""
    x = logits[..., verb_ids]
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


class ActorProbe:
    """Per kind of held-out actor example, the probability the model gives (among the actions) to: the applying
    lesson's verb (``follow``), other families' claimed verbs when no lesson applies (``copy_other``), verbs its own
    family's lessons say failed (``play_failed``), verbs already failed in the episode (``stale_play``); and the
    largest action probability with no lesson at all (``none_max``, 0.125 = uniform)."""

    def __init__(self, held, tok, model_cfg=None, batch: int = 100):
        self.held, self.tok, self.batch = list(held), tok, batch
        self.rows = [a.ids(tok) for a in self.held]
        self.verb_ids = np.array([tok.encode(v)[0] for v in C.VERBS])
        self.length = max(len(p) + len(a) for p, a in self.rows)
        self._fn = jax.jit(sft.answer_logits, static_argnums=0)
        self._graphdef = None if model_cfg is None else dec.abstract_decoder(model_cfg)[0]

    def probs(self, graphdef, params) -> np.ndarray:
        out = []
        for i in range(0, len(self.rows), self.batch):
            rows = self.rows[i : i + self.batch]
            arr = sft.pack(rows, self.tok.pad_id, 2, self.length, self.batch)
            lg = np.asarray(self._fn(graphdef, params, arr[0], arr[1], arr[2]))[: len(rows)]
            out.append(_verb_probs(lg[:, 1], self.verb_ids))  # answer token 1: the action after <answer>
        return np.concatenate(out)

    def __call__(self, step, params, graphdef=None) -> dict:
        p = self.probs(graphdef or self._graphdef or _graphdef_of(params), params)
        acc = collections.defaultdict(list)
        ix = {v: i for i, v in enumerate(C.VERBS)}
        for n, a in enumerate(self.held):
            if a.kind == "follow":
                acc["follow"].append(p[n, ix[a.target]])
            elif a.kind == "other":
                claimed = {x.verbs[0] for x in a.entries if x.works and x.verbs[0] in ix}
                acc["copy_other"].append(sum(p[n, ix[v]] for v in claimed) / max(len(claimed), 1))
            elif a.kind == "avoid":
                bad = {v for x in a.entries if x.family == a.family for v in x.verbs}
                acc["play_failed"].append(sum(p[n, ix[v]] for v in bad))
            elif a.kind == "stale":
                acc["stale_play"].append(sum(p[n, ix[v]] for v in a.history))
            elif a.kind == "none":
                acc["none_max"].append(p[n].max())
        return {k: round(float(np.mean(v)), 4) for k, v in sorted(acc.items())}


def _graphdef_of(params):
    raise ValueError("ActorProbe needs the model config (or a graphdef) to run the model")


class ExtractorProbe:
    """Held-out distillations after a success: the share whose answer's family and verb tokens are the model's
    greedy choice under teacher forcing (``right_after_success``), a cheap stand-in for the right-lesson share."""

    def __init__(self, held, tok, ex_args, model_cfg, batch: int = 100):
        self.tok, self.batch = tok, batch
        self.held = [e for e in held if e.success]
        self.rows = [e.ids(tok, *ex_args) for e in self.held]
        keys = {tok.encode(w)[0] for w in C.atomic_words()}
        # answer positions holding a family or an action (atomic tokens): what a right lesson must get right
        self.where = [[i for i, t in enumerate(r[1]) if t in keys] for r in self.rows]
        self.max_answer = max(len(r[1]) for r in self.rows)
        self.length = max(len(p) + len(a) for p, a in self.rows)
        self._fn = jax.jit(sft.answer_logits, static_argnums=0)
        self._graphdef = dec.abstract_decoder(model_cfg)[0]

    def __call__(self, step, params) -> dict:
        right = []
        for i in range(0, len(self.rows), self.batch):
            rows = self.rows[i : i + self.batch]
            arr = sft.pack(rows, self.tok.pad_id, self.max_answer, self.length, self.batch)
            greedy = np.argmax(np.asarray(self._fn(self._graphdef, params, arr[0], arr[1], arr[2])), -1)
            for b, (_, ans) in enumerate(rows):
                pos = self.where[i + b]
                right.append(bool(pos) and all(greedy[b, k] == ans[k] for k in pos))
        return {"right_after_success": round(float(np.mean(right)), 4)}
