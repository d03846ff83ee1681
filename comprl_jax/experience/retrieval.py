"""Retrieval pieces (SPEC §5): the LRU query-embedding cache, Eq. 6 diversified re-rank, the experience block."""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np

from comprl_jax.experience.ops import MEMORY_RE

EXPERIENCE_HEADER = (
    "Experience from earlier episodes (distilled automatically from past attempts at similar tasks). "
    "It may be partly wrong or incomplete: use what helps here and do not over-fit to it."
)
NO_EXPERIENCE = "[No experience found]"


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    top_k: int = 1  # K entries put in the prompt
    num_candidates: int = 16  # N*K fetched from the index before the re-rank
    lam: float = 0.4  # lambda of Eq. 6
    window_s: float = 300.0  # recency window of Eq. 6, clock seconds
    dropout: float = 0.5  # released code: a recently retrieved top-1 goes to the end with this probability

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_candidates:
            raise ValueError(
                f"retrieval needs 1 <= top_k <= num_candidates, got {self.top_k}, {self.num_candidates}"
            )
        if not 0.0 <= self.dropout <= 1.0:
            raise ValueError(f"retrieval.dropout must be in [0, 1], got {self.dropout}")


def eq6_scores(
    retrievals: Sequence[int], last_retrieved: Sequence[float | None], now: float, lam: float, window_s: float
) -> np.ndarray:
    """Eq. 6 for candidates given best-first: s(m) = -rank(m) - lam*log(1+retrievals(m)) - 1[retrieved recently].

    Args:
      retrievals: retrieval count of each candidate, [C], in similarity order (rank 1 first).
      last_retrieved: clock time of each candidate's last retrieval (None = never), [C].
      now: current clock time.

    Returns:
      [C] float64 scores, higher is better.
    """
    rank = np.arange(1, len(retrievals) + 1, dtype=np.float64)
    count = np.log1p(np.asarray(retrievals, np.float64))
    recent = np.array([t is not None and now - t < window_s for t in last_retrieved], np.float64)
    return -rank - lam * count - recent


def diversify(
    retrievals: Sequence[int],
    last_retrieved: Sequence[float | None],
    now: float,
    cfg: RetrievalConfig,
    rng: np.random.Generator,
) -> list[int]:
    """Eq. 6 re-rank plus the top-1 dropout; returns positions (into the candidate list) of the chosen top K.

    The RNG is drawn only when the top-1 after the re-rank was retrieved within the window, so the draw sequence
    (and hence a restored store's answers) depends only on the bank state.
    """
    n = len(retrievals)
    if n == 0:
        return []
    s = eq6_scores(retrievals, last_retrieved, now, cfg.lam, cfg.window_s)
    order = sorted(range(n), key=lambda i: (-s[i], i))  # ties: the more similar candidate first
    top = order[0]
    t = last_retrieved[top]
    if cfg.dropout > 0 and n > 1 and t is not None and now - t < cfg.window_s and rng.random() < cfg.dropout:
        order = order[1:] + [top]
    return order[: cfg.top_k]


def format_entry(text: str) -> str:
    m = MEMORY_RE.match(text)
    return f"{m.group(1).strip()}: {m.group(2).strip()}" if m else text.strip()


def format_experience(texts: Sequence[str]) -> str:
    """The block put in the actor's system message: header, then numbered entries (or "[No experience found]")."""
    if not texts:
        return f"{EXPERIENCE_HEADER}\n{NO_EXPERIENCE}"
    body = "\n".join(f"{i}. {format_entry(t)}" for i, t in enumerate(texts, start=1))
    return f"{EXPERIENCE_HEADER}\n{body}"


class EmbedCache:
    """Thread-safe LRU cache in front of ``embed_fn(texts) -> [N, D]`` float32 (L2-normalised).

    Misses are embedded in one ``embed_fn`` call per lookup, one call at a time (``_embed_lock``): the embedder is a
    jitted JAX model whose XLA thread pool already uses every core, and concurrent first calls would compile the
    same shapes twice.
    """

    def __init__(self, embed_fn: Callable[[list[str]], np.ndarray], size: int = 1000):
        self.embed_fn, self.size = embed_fn, size
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._embed_lock = threading.Lock()
        self.hits = self.misses = 0

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        out: list[np.ndarray | None] = [None] * len(texts)
        with self._lock:
            for i, t in enumerate(texts):
                if t in self._cache:
                    self._cache.move_to_end(t)
                    out[i] = self._cache[t]
                    self.hits += 1
        missing = list(dict.fromkeys(t for t, v in zip(texts, out, strict=True) if v is None))
        if missing:
            with self._embed_lock:
                vecs = np.asarray(self.embed_fn(missing), np.float32)
            if vecs.ndim != 2 or vecs.shape[0] != len(missing):
                raise ValueError(f"embed_fn returned shape {vecs.shape} for {len(missing)} texts")
            fresh = dict(zip(missing, vecs, strict=True))
            with self._lock:
                self.misses += len(missing)
                for t, v in fresh.items():
                    self._cache[t] = v
                    self._cache.move_to_end(t)
                while len(self._cache) > self.size:
                    self._cache.popitem(last=False)
            out = [fresh[t] if v is None else v for t, v in zip(texts, out, strict=True)]
        if not texts:
            return np.zeros((0, 0), np.float32)
        return np.stack(out).astype(np.float32)
