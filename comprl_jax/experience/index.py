"""Vector index of one bank partition: exact dot product when small, ScaNN when large, rebuilt in the background.

Rows are kept in uid order (uids grow monotonically), so "entries added since the last ScaNN build" is a suffix of
the row arrays. A search asks the last built ScaNN searcher (rows deleted since the build are masked; it over-fetches by
the number of such rows) and runs an exact dot product over the suffix, then merges the two. ScaNN's ``reorder`` step
rescores candidates with exact float32 dot products, so scores from both halves are comparable.

The index does no locking of its own: the bank's owner holds a reader lock around :meth:`search` and the writer lock
around :meth:`add` / :meth:`remove`. A background build works on a copy taken at trigger time and publishes its result
with one reference assignment, so searches never wait for a build.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading

import numpy as np

_NEG = np.float32(-np.inf)


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    scann_min_size: int = 4096  # below this many rows, exact search (ScaNN's k-means needs enough points)
    rebuild_fraction: float = (
        0.1  # rebuild when added-since-build or deleted-since-build exceeds this * built size
    )
    background: bool = True  # False: build inline (deterministic; for replay and tests)
    leaves_per_sqrt: float = 1.0  # num_leaves = leaves_per_sqrt * sqrt(n)
    leaves_to_search_frac: float = 0.05  # search-time; 100k clustered bench: recall@16 1.0 (see launch/bench)
    reorder: int = 128  # candidates rescored exactly (search-time)
    max_overfetch: int = 4096  # past this many masked rows, fall back to exact search


@dataclasses.dataclass(frozen=True)
class BuiltIndex:
    """A published ScaNN searcher over ``uids`` (ascending); ``max_uid`` marks where the unindexed suffix starts."""

    searcher: object
    uids: np.ndarray  # [n_built] int64
    max_uid: int
    num_leaves: int = 0  # 0: unknown, searches use the searcher's built-in leaves_to_search


def num_leaves(n: int, cfg: IndexConfig) -> int:
    return max(2, min(int(cfg.leaves_per_sqrt * np.sqrt(n)), n // 8))


def build_scann(emb: np.ndarray, cfg: IndexConfig, num_neighbors: int = 16):
    """Builds a ScaNN dot-product searcher over ``emb`` [N, D] float32 (N >= 16)."""
    from scann.scann_ops.py import scann_ops_pybind

    n = emb.shape[0]
    leaves = num_leaves(n, cfg)
    search = max(1, int(np.ceil(leaves * cfg.leaves_to_search_frac)))
    b = scann_ops_pybind.builder(emb, num_neighbors, "dot_product")
    b = b.tree(num_leaves=leaves, num_leaves_to_search=search, training_sample_size=min(n, 100_000))
    b = b.score_ah(2, anisotropic_quantization_threshold=0.2).reorder(max(cfg.reorder, num_neighbors))
    return b.build()


def save_scann(searcher, directory: str) -> None:
    """Writes ScaNN's own assets (protobuf + .npy; we never pass docids, so no pickle is written)."""
    os.makedirs(directory, exist_ok=True)
    searcher.searcher.serialize(directory, True)


def load_scann(directory: str):
    """Loads assets written by :func:`save_scann` without ScaNN's docid pickle path."""
    from scann.scann_ops.py import scann_ops_pybind

    if any(f.endswith(".pkl") for f in os.listdir(directory)):
        raise ValueError(f"refusing to load pickled ScaNN docids in {directory}")
    with open(os.path.join(directory, "scann_assets.pbtxt")) as f:
        return scann_ops_pybind.ScannSearcher(scann_ops_pybind.scann_pybind.ScannNumpy(directory, f.read()))


_BUILD_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="scann-build")


class PartitionIndex:
    """Rows of one partition: ``uids`` [n] int64 ascending, ``emb`` [n, D] float32, ``alive`` [n] bool."""

    def __init__(self, dim: int, cfg: IndexConfig = IndexConfig(), writer_lock=None):
        """``writer_lock``: zero-arg callable returning the owner's writer-lock context, taken to publish a build."""
        self.dim, self.cfg = dim, cfg
        own = threading.Lock()
        self._writer_lock = writer_lock if writer_lock is not None else (lambda: own)
        self._emb = np.zeros((16, dim), np.float32)
        self._uids = np.zeros(16, np.int64)
        self._alive = np.zeros(16, bool)
        self._n = 0
        self._slot: dict[int, int] = {}
        self.built: BuiltIndex | None = None
        self._dead_in_built = 0
        self._pending: concurrent.futures.Future | None = None
        self.num_builds = 0

    # -- mutation (caller holds the writer lock) ----------------------------------------------------
    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, uid: int) -> bool:
        return uid in self._slot

    def add(self, uid: int, vec: np.ndarray) -> None:
        if self._n and uid <= self._uids[self._n - 1]:
            raise ValueError(f"uids must be added in increasing order: {uid} after {self._uids[self._n - 1]}")
        if self._n == len(self._uids):
            grow = max(16, self._n)
            self._emb = np.concatenate([self._emb, np.zeros((grow, self.dim), np.float32)])
            self._uids = np.concatenate([self._uids, np.zeros(grow, np.int64)])
            self._alive = np.concatenate([self._alive, np.zeros(grow, bool)])
        self._emb[self._n] = vec
        self._uids[self._n] = uid
        self._alive[self._n] = True
        self._slot[uid] = self._n
        self._n += 1
        self._maybe_rebuild()

    def remove(self, uid: int) -> None:
        slot = self._slot.pop(uid)
        self._alive[slot] = False
        built = self.built
        if built is not None and uid <= built.max_uid:
            self._dead_in_built += 1
        if self._n - len(self._slot) > max(64, self._n // 2):
            self._compact()
        self._maybe_rebuild()

    def load_rows(self, uids: np.ndarray, emb: np.ndarray) -> None:
        """Replaces all rows (restore path; ascending uids) without triggering a build."""
        n = len(uids)
        cap = max(16, 2 * n)
        self._emb = np.zeros((cap, self.dim), np.float32)
        self._emb[:n] = emb
        self._uids = np.zeros(cap, np.int64)
        self._uids[:n] = uids
        self._alive = np.zeros(cap, bool)
        self._alive[:n] = True
        self._n = n
        self._slot = {int(u): i for i, u in enumerate(uids.tolist())}
        self.built, self._dead_in_built = None, 0

    def vector(self, uid: int) -> np.ndarray:
        return self._emb[self._slot[uid]].copy()

    def alive_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(uids [n], emb [n, D]) of the live rows, in uid order (copies)."""
        m = self._alive[: self._n]
        return self._uids[: self._n][m].copy(), self._emb[: self._n][m].copy()

    def _compact(self) -> None:
        # New arrays rather than in-place moves: nothing else holds slot numbers, and a build in flight has its copy.
        built, dead = self.built, self._dead_in_built
        self.load_rows(*self.alive_rows())
        self.built, self._dead_in_built = built, dead

    def _maybe_rebuild(self) -> None:
        cfg = self.cfg
        if len(self._slot) < cfg.scann_min_size:
            self.built, self._dead_in_built = None, 0
            return
        if self._pending is not None and not self._pending.done():
            return
        built = self.built
        if built is not None:
            n_new = self._n - int(np.searchsorted(self._uids[: self._n], built.max_uid, side="right"))
            limit = cfg.rebuild_fraction * len(built.uids)
            if n_new <= limit and self._dead_in_built <= limit:
                return
        uids, emb = self.alive_rows()
        if cfg.background:
            self._pending = _BUILD_POOL.submit(self._build_and_publish, uids, emb)
        else:  # the caller already holds the writer lock
            self.set_built(BuiltIndex(build_scann(emb, cfg), uids, int(uids[-1]), num_leaves(len(uids), cfg)))
            self.num_builds += 1

    def _build_and_publish(self, uids: np.ndarray, emb: np.ndarray) -> None:
        searcher = build_scann(emb, self.cfg)
        # Publish under the writer lock so the masked-row count cannot race with a concurrent remove().
        with self._writer_lock():
            if len(self._slot) >= self.cfg.scann_min_size:
                self.set_built(BuiltIndex(searcher, uids, int(uids[-1]), num_leaves(len(uids), self.cfg)))
                self.num_builds += 1

    def set_built(self, built: BuiltIndex | None) -> None:
        """Publishes a built searcher; counts built rows deleted since its snapshot so they are over-fetched."""
        if built is not None:
            self._dead_in_built = int(sum(1 for u in built.uids.tolist() if u not in self._slot))
        else:
            self._dead_in_built = 0
        self.built = built

    def wait_for_build(self) -> None:
        if self._pending is not None:
            self._pending.result()

    # -- search (caller holds a reader lock) ---------------------------------------------------------
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k live rows by dot product.

        Args:
          queries: [Q, D] float32.
          k: number of neighbours.

        Returns:
          (uids [Q, k] int64 padded with -1, scores [Q, k] float32 padded with -inf), best first.
        """
        queries = np.ascontiguousarray(queries, np.float32)
        q = queries.shape[0]
        built = self.built  # read once: a concurrent publish must not change it mid-search
        n = self._n
        if built is None or self._dead_in_built + k > self.cfg.max_overfetch:
            return self._exact(queries, k, 0, n)
        start = int(np.searchsorted(self._uids[:n], built.max_uid, side="right"))
        fetch = min(len(built.uids), k + self._dead_in_built)
        idx, dist = built.searcher.search_batched(
            queries,
            final_num_neighbors=fetch,
            pre_reorder_num_neighbors=max(self.cfg.reorder, fetch),
            # Search-time knob (the config may be tuned without a rebuild); -1 = the searcher's default.
            leaves_to_search=max(1, int(np.ceil(built.num_leaves * self.cfg.leaves_to_search_frac)))
            if built.num_leaves
            else -1,
        )
        idx = np.asarray(idx, np.int64).reshape(q, -1)
        dist = np.asarray(dist, np.float32).reshape(q, -1)
        cand_u = built.uids[np.clip(idx, 0, len(built.uids) - 1)]
        alive = np.array([u in self._slot for u in cand_u.ravel().tolist()], bool).reshape(cand_u.shape)
        dist = np.where(alive & (idx >= 0), dist, _NEG)
        du, ds = self._exact(queries, k, start, n)
        return _merge_topk(np.concatenate([cand_u, du], 1), np.concatenate([dist, ds], 1), k)

    def _exact(self, queries: np.ndarray, k: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        scores = queries @ self._emb[lo:hi].T
        scores = np.where(self._alive[lo:hi][None, :], scores, _NEG).astype(np.float32)
        return _merge_topk(np.broadcast_to(self._uids[lo:hi], scores.shape), scores, k)


def _merge_topk(uids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k columns per row by score (ties: lower uid first, so results are deterministic), -1/-inf padded."""
    q, m = scores.shape
    out_u = np.full((q, k), -1, np.int64)
    out_s = np.full((q, k), _NEG, np.float32)
    if m == 0:
        return out_u, out_s
    if m > 4 * k:
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k] if k < m else np.arange(m)[None].repeat(q, 0)
        # argpartition may split ties at the boundary arbitrarily; keep every column tied with the k-th score.
        kth = np.take_along_axis(scores, part, 1).min(1, keepdims=True)
        keep = [np.nonzero(scores[i] >= kth[i])[0] for i in range(q)]
    else:
        keep = [np.arange(m)] * q
    for i in range(q):
        cols = keep[i]
        s, u = scores[i, cols], uids[i, cols]
        ok = np.isfinite(s)
        s, u = s[ok], u[ok]
        order = np.lexsort((u, -s))[:k]
        out_u[i, : len(order)] = u[order]
        out_s[i, : len(order)] = s[order]
    return out_u, out_s
