"""BM25 search over the catalogue's ``contents`` field (PyPI ``rank-bm25``, ``BM25Okapi`` with k1 = 0.9, b = 0.4).

The original WebShop searches a pyserini/Lucene index (Lucene's BM25 with k1 = 0.9, b = 0.4, an English analyzer:
lowercasing, stop words, Porter stemming) and returns the top 50 hits. Here the same parameters run through
``rank_bm25``; the analyzer is approximated by lowercasing, alphanumeric tokens, Lucene's 33 English stop words and a
light plural strip (no Porter stemmer: it is not in the standard library, and "shoes"/"shoe" is the case that
matters for product search). ``rank_bm25``'s IDF also differs slightly from Lucene's (it floors the IDF of very common
terms at ``epsilon`` × mean IDF instead of using log(1 + ...)), so ranks can differ from the original's; only
documents sharing at least one term with the query are returned, as with Lucene.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from rank_bm25 import BM25Okapi

K1 = 0.9
B = 0.4
TOP_N = 50

# Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET.
STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these "
    "they this to was will with".split()
)
_TOKEN_RE = re.compile(r"[a-z0-9]+")


def _strip_plural(token: str) -> str:
    # The common English plural endings; keeps "glass", "dress", "series", short words and numbers intact.
    if len(token) <= 3 or token.isdigit() or token.endswith(("ss", "us", "is")):
        return token
    if token.endswith("ies") and len(token) > 4:
        return token[:-3] + "y"
    if token.endswith(("ches", "shes", "xes", "zes", "sses")):
        return token[:-2]
    if token.endswith("s"):
        return token[:-1]
    return token


def tokenize(text: str) -> list[str]:
    """Lowercase alphanumeric tokens minus stop words, plurals stripped: ``"Red Shoes for men" -> [red, shoe, men]``."""
    return [_strip_plural(t) for t in _TOKEN_RE.findall(text.lower()) if t not in STOP_WORDS]


class SearchEngine:
    """BM25 over a fixed list of documents; ``search`` returns document indices, best first.

    Args:
        contents: the text of each document (here the products' ``contents``), in catalogue order.
    """

    def __init__(self, contents: Sequence[str]):
        self._tokens = [tokenize(c) for c in contents]
        self._bm25 = BM25Okapi(self._tokens, k1=K1, b=B)
        self._vocab = [set(t) for t in self._tokens]

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query``: [N] float64."""
        return np.asarray(self._bm25.get_scores(tokenize(query)), dtype=np.float64)

    def search(self, query: str, k: int = TOP_N) -> list[int]:
        """Indices of the (at most ``k``) best documents that share a term with ``query``; ties by catalogue order."""
        terms = set(tokenize(query))
        if not terms:
            return []
        scores = self.scores(query)
        order = np.argsort(
            -scores, kind="stable"
        )  # stable: equal scores keep catalogue order (deterministic)
        return [int(i) for i in order if self._vocab[i] & terms][:k]
