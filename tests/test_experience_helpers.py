"""Shared helpers for tests/test_experience_*.py: a deterministic hashing embedder and a scripted extractor."""

import hashlib
import json

import numpy as np

DIM = 32


def hash_embed(texts):
    """Deterministic bag-of-words embedding [N, DIM] float32, L2-normalised (shared words -> similar vectors)."""
    out = np.zeros((len(texts), DIM), np.float32)
    for i, t in enumerate(texts):
        for w in t.lower().split():
            h = hashlib.sha256(w.encode()).digest()
            rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
            out[i] += rng.standard_normal(DIM).astype(np.float32)
        if not t.split():
            out[i, 0] = 1.0
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def mem(title, content):
    return f"<title>{title}</title><content>{content}</content>"


def answer(*ops):
    return "<think>ok</think><answer>" + json.dumps(list(ops)) + "</answer>"


def add(text):
    return {"function_name": "add", "parameters": {"new_memory": text}}


def update(idx, text):
    return {"function_name": "update", "parameters": {"target_idx": list(idx), "new_memory": text}}


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t
