"""Retrieval pieces (SPEC §5): the LRU query-embedding cache, Eq. 6 diversified re-rank, the experience block."""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np

from comprl_jax.experience.ops import MEMORY_RE
from comprl_jax.runtime.fields import check

EXPERIENCE_HEADER = (
    "Experience from earlier episodes (distilled automatically from past attempts at similar tasks). "
    "It may be partly wrong or incomplete: use what helps here and do not over-fit to it."
)
NO_EXPERIENCE = "[No experience found]"


@dataclasses.dataclass(frozen=True)
class ExperienceConfig:
    """Config section ``experience``: the experience side of the loop at all.

    Attributes:
      enabled: retrieval, bank and extractor at all (False: the outcome-only baseline).
      blank: control arm (method blank_exp): the guided half sees the experience header and filler of the same
        token length (:func:`blank_experience`) instead of the retrieved entries.
    """

    enabled: bool = True
    blank: bool = False

    def __post_init__(self):
        check(
            self.enabled or not self.blank,
            "blank",
            "needs experience.enabled (it replaces retrieved experience)",
            self.blank,
        )


CLOCKS = ("step", "wall")


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """Config section ``retrieval`` (SPEC §5): the Eq. 6 re-rank, the embedder and the actor's search & ask.

    Attributes:
      k: K entries put in the prompt.
      candidates: N*K fetched from the index before the re-rank.
      lam: lambda of Eq. 6.
      dropout: released code: a recently retrieved top-1 goes to the end with this probability.
      clock / window_steps / window_s: the recency clock of Eq. 6 and its window (:attr:`window`): ``"step"`` counts
        rollout steps (deterministic: exact resume), ``"wall"`` is ``time.time()`` as in the released code (paper:
        300 s).
      embedder: ``"minilm"`` (CPU) or a local Qwen3-Embedding folder (the paper's; read by the trainer).
      search_and_ask / search_and_ask_max / search_and_ask_guided_only: the actor's search & ask tool calls per
        episode (read by the rollout, ``rollout.search_ask``).
    """

    k: int = 1
    candidates: int = 16
    lam: float = 0.4
    dropout: float = 0.5
    clock: str = "wall"
    window_steps: int = 1
    window_s: float = 300.0
    embedder: str = "minilm"
    search_and_ask: bool = True
    search_and_ask_max: int = 2
    search_and_ask_guided_only: bool = True

    def __post_init__(self):
        check(self.k >= 1, "k", "must be >= 1", self.k)
        check(self.candidates >= self.k, "candidates", f"must be >= retrieval.k={self.k}", self.candidates)
        check(0.0 <= self.dropout <= 1.0, "dropout", "must be in [0, 1]", self.dropout)
        check(self.clock in CLOCKS, "clock", f"must be one of {CLOCKS}", self.clock)
        check(self.window_steps >= 0, "window_steps", "must be >= 0", self.window_steps)
        check(self.search_and_ask_max >= 0, "search_and_ask_max", "must be >= 0", self.search_and_ask_max)

    @property
    def window(self) -> float:
        """Eq. 6's recency window in the manager's clock units (steps or seconds)."""
        return self.window_s if self.clock == "wall" else float(self.window_steps)


def eq6_scores(
    retrievals: Sequence[int], last_retrieved: Sequence[float | None], now: float, lam: float, window: float
) -> np.ndarray:
    """Eq. 6 for candidates given best-first: s(m) = -rank(m) - lam*log(1+retrievals(m)) - 1[retrieved recently].

    Args:
      retrievals: retrieval count of each candidate, [C], in similarity order (rank 1 first).
      last_retrieved: clock time of each candidate's last retrieval (None = never), [C].
      now: current clock time; window: the recency window in the same units.

    Returns:
      [C] float64 scores, higher is better.
    """
    rank = np.arange(1, len(retrievals) + 1, dtype=np.float64)
    count = np.log1p(np.asarray(retrievals, np.float64))
    recent = np.array([t is not None and now - t < window for t in last_retrieved], np.float64)
    return -rank - lam * count - recent


def diversify(
    retrievals: Sequence[int],
    last_retrieved: Sequence[float | None],
    now: float,
    cfg: RetrievalConfig,
    rng: np.random.Generator | None,
) -> list[int]:
    """Eq. 6 re-rank plus the top-1 dropout; returns positions (into the candidate list) of the chosen top K.

    The RNG is drawn only when the top-1 after the re-rank was retrieved within the window, so the draw sequence
    (and hence a restored store's answers) depends only on the bank state. ``rng=None``: no dropout (read-only
    searches, e.g. evaluation, must not advance the training RNG).
    """
    n = len(retrievals)
    if n == 0:
        return []
    s = eq6_scores(retrievals, last_retrieved, now, cfg.lam, cfg.window)
    order = sorted(range(n), key=lambda i: (-s[i], i))  # ties: the more similar candidate first
    top = order[0]
    t = last_retrieved[top]
    recent = t is not None and now - t < cfg.window
    if rng is not None and cfg.dropout > 0 and n > 1 and recent and rng.random() < cfg.dropout:
        order = order[1:] + [top]
    return order[: cfg.k]


def format_entry(text: str) -> str:
    m = MEMORY_RE.match(text)
    return f"{m.group(1).strip()}: {m.group(2).strip()}" if m else text.strip()


def format_experience(texts: Sequence[str]) -> str:
    """The block put in the actor's system message: header, then numbered entries (or "[No experience found]")."""
    if not texts:
        return f"{EXPERIENCE_HEADER}\n{NO_EXPERIENCE}"
    body = "\n".join(f"{i}. {format_entry(t)}" for i, t in enumerate(texts, start=1))
    return f"{EXPERIENCE_HEADER}\n{body}"


BLANK_FILLER = " ."


def blank_experience(block: str, count_tokens: Callable[[str], int]) -> str:
    """The control arm's block (config ``experience.blank``): the header and ``[No experience found]``, padded with
    filler to at least the token length of ``block``, so the guided half keeps its prompt length but sees no
    content. ``count_tokens``: the actor tokenizer's token count of a text."""
    base = format_experience([])
    want = count_tokens(block)
    have = count_tokens(base)
    if have >= want:
        return base
    k = max(1, (want - have) // max(1, count_tokens(BLANK_FILLER.strip())))
    while count_tokens(base + "\n" + BLANK_FILLER * k) > want and k > 1:  # a filler unit may be 2 tokens
        k -= 1
    while count_tokens(base + "\n" + BLANK_FILLER * k) < want:
        k += 1
    return base + "\n" + BLANK_FILLER * k


class EmbedCache:
    """Thread-safe LRU cache in front of ``embed_fn(texts) -> [N, D]`` float32 (L2-normalised).

    Misses are embedded in one ``embed_fn`` call per lookup; at most ``workers`` lookups embed at once (the
    paper's embedding workers, config ``manager.embed_workers``). Concurrent calls overlap host-side tokenisation
    and device dispatch of different search micro-batches; on a CPU, whose XLA thread pool already uses every
    core, 1 is as fast.
    """

    def __init__(self, embed_fn: Callable[[list[str]], np.ndarray], size: int = 1000, workers: int = 1):
        if workers < 1:
            raise ValueError(f"manager.embed_workers must be >= 1, got {workers}")
        self.embed_fn, self.size = embed_fn, size
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._embed_lock = threading.Semaphore(workers)
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

    def state_dict(self) -> dict:
        """``{"keys": [text, ...] (LRU order, oldest first), "vectors": [N, D] float32}`` (copies). A resumed run
        must see the same cache hits: an embedding computed in another batch may differ in the last bit."""
        with self._lock:
            keys = list(self._cache)
            vecs = [self._cache[k] for k in keys]
        return {
            "keys": keys,
            "vectors": np.stack(vecs).astype(np.float32) if vecs else np.zeros((0, 0), np.float32),
        }

    def load_state_dict(self, state: dict) -> None:
        keys, vecs = list(state["keys"]), np.asarray(state["vectors"], np.float32)
        if len(vecs) != len(keys):
            raise ValueError(f"query cache state: {len(vecs)} vectors for {len(keys)} keys")
        with self._lock:
            self._cache.clear()
            for k, v in zip(keys, vecs, strict=True):
                self._cache[k] = np.asarray(v, np.float32)


def corpus_strings() -> list[str]:
    """The experience block's text (a tiny run's tokenizer is trained on it)."""
    lesson = "<title>move east</title><content>the stairs are often east</content>"
    return [format_experience([lesson]), format_experience([])]
