"""Retrieval benchmark: ScaNN (the production PartitionIndex path) vs exact NumPy, plus one end-to-end line.

COMMAND:  .venv/bin/python launch/bench/retrieval.py [--sizes=20000,100000,1000000] [--e2e_n=20000]

Prints one JSON object per line: {"bench": "retrieval", "n", "method", "batch": 16, "p50_ms", "p99_ms",
"recall_at_1", "recall_at_16", ...}. Data: unit-normalised 384-d vectors from a Gaussian mixture (clustered, like
sentence embeddings; uniform noise would make every neighbour equally far), with n/100 clusters so a cluster holds
~100 points and the true top-16 are well defined (with ~10 points per cluster, neighbours 11-16 sit at near-random
similarity and recall@16 measures noise). Queries are fresh draws from the same mixture. Recall is measured against exact dot-product top-k. The "e2e" line times ExperienceManager.search on 16 new
query strings: MiniLM embedding (JAX, comprl_jax.models.embedders) + micro-batched search + Eq. 6 diversification,
over a bank of ``--e2e_n`` entries (synthetic key vectors; the query side is real MiniLM).
Targets (issue 5): ScaNN at 100k p99 <= 5 ms per batch of 16 with recall@16 >= 0.95; at 1M >= 10x faster than exact;
e2e p99 <= 100 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from comprl_jax.experience.index import BuiltIndex, IndexConfig, PartitionIndex, build_scann, num_leaves  # noqa: E402

DIM, BATCH, K = 384, 16, 16


def mixture(n: int, rng: np.random.Generator, centers: np.ndarray, sigma: float = 0.5) -> np.ndarray:
    """``n`` unit vectors: a random unit-norm center plus isotropic noise of expected norm ``sigma``."""
    out = np.empty((n, DIM), np.float32)
    for s in range(0, n, 100_000):  # chunked: keeps temporaries small at 1M
        m = min(100_000, n - s)
        noise = rng.standard_normal((m, DIM), np.float32) * np.float32(sigma / np.sqrt(DIM))
        x = centers[rng.integers(0, len(centers), m)] + noise
        out[s : s + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def exact_topk(q: np.ndarray, db: np.ndarray, k: int) -> np.ndarray:
    s = q @ db.T
    part = np.argpartition(-s, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(s, part, 1), axis=1)
    return np.take_along_axis(part, order, 1)


def timed(fn, reps: int) -> np.ndarray:
    ms = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1e3)
    return np.array(ms)


def line(**kw) -> None:
    print(json.dumps({"bench": "retrieval", "batch": BATCH, **kw}), flush=True)


def bench_size(n: int, rng: np.random.Generator, num_queries: int, cfg: IndexConfig, reps: int) -> None:
    centers = rng.standard_normal((max(16, n // 100), DIM)).astype(np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    db, queries = mixture(n, rng, centers), mixture(num_queries, rng, centers)
    # Exact search: the ground-truth batches double as its timing samples (repeated for small n).
    truth, ms = [], []
    for _ in range(max(1, min(reps * BATCH // num_queries, int(2e6 // n)))):
        truth = []
        for i in range(0, len(queries), BATCH):
            t = time.perf_counter()
            truth.append(exact_topk(queries[i : i + BATCH], db, K))
            ms.append((time.perf_counter() - t) * 1e3)
    truth = np.concatenate(truth)
    line(
        n=n,
        method="exact",
        p50_ms=round(float(np.percentile(ms, 50)), 3),
        p99_ms=round(float(np.percentile(ms, 99)), 3),
        recall_at_1=1.0,
        recall_at_16=1.0,
        reps=len(ms),
    )
    exact_p50 = float(np.percentile(ms, 50))
    t = time.perf_counter()
    searcher = build_scann(db, cfg)
    build_s = time.perf_counter() - t
    ix = PartitionIndex(DIM, IndexConfig(scann_min_size=10**12))  # rows loaded directly; no auto build
    uids = np.arange(n, dtype=np.int64)
    ix.load_rows(uids, db)
    ix.set_built(BuiltIndex(searcher, uids, n - 1, num_leaves(n, cfg)))
    got = np.concatenate([ix.search(queries[i : i + BATCH], K)[0] for i in range(0, len(queries), BATCH)])
    r1 = float(np.mean(got[:, 0] == truth[:, 0]))
    r16 = float(np.mean([len(set(g) & set(t)) / K for g, t in zip(got, truth, strict=True)]))
    batches = [queries[i : i + BATCH] for i in range(0, len(queries), BATCH)]
    i = [0]

    def one():
        ix.search(batches[i[0] % len(batches)], K)
        i[0] += 1

    ms = timed(one, reps)
    del db
    line(
        n=n,
        method="scann",
        p50_ms=round(float(np.percentile(ms, 50)), 3),
        p99_ms=round(float(np.percentile(ms, 99)), 3),
        recall_at_1=round(r1, 4),
        recall_at_16=round(r16, 4),
        reps=reps,
        build_s=round(build_s, 2),
        speedup_p50=round(exact_p50 / float(np.percentile(ms, 50)), 1),
        leaves_to_search_frac=cfg.leaves_to_search_frac,
        reorder=cfg.reorder,
    )


def bench_e2e(n: int, rng: np.random.Generator, centers: np.ndarray, reps: int) -> None:
    from comprl_jax.experience import BankConfig
    from comprl_jax.models.embedders import get_embedder
    from launch.threaded_manager import ThreadedExperienceManager

    emb = get_embedder("minilm")
    mgr = ThreadedExperienceManager(
        emb.embed, emb.dim, bank_cfg=BankConfig(index=IndexConfig(scann_min_size=10**12))
    )
    if emb.dim != DIM:
        raise ValueError(f"MiniLM dim {emb.dim} != {DIM}")
    keys = mixture(n, rng, centers)
    with mgr.lock.write():  # fill directly (synthetic keys); then publish one ScaNN build as the bank would
        for i in range(n):
            mgr.bank.add("task", f"<title>lesson {i}</title><content>tip {i}</content>", keys[i], step=0)
        ix = mgr.bank.indexes["task"]
        uids, vecs = ix.alive_rows()
        ix.set_built(
            BuiltIndex(
                build_scann(vecs, IndexConfig()), uids, int(uids[-1]), num_leaves(len(uids), IndexConfig())
            )
        )
    words = ["key", "door", "stairs", "east", "west", "lava", "box", "apple", "fridge", "shop", "red", "blue"]
    counter = [10_000]  # fixed digit count: every query lands in the same token-length bucket

    def queries():
        out = []
        for _ in range(BATCH):
            c = counter[0]
            counter[0] += 1
            out.append(
                f"Go to the {words[c % 12]} near the {words[(c // 12) % 12]} room {c} and find the stairs."
            )
        return out

    # Warm-up: the jitted embedder compiles once per (batch bucket, length bucket); a micro-batch may be split
    # by the 1 ms flush, so compile every batch bucket before timing (steady state of a long run).
    for b in (1, 2, 4, 8, 16):
        emb.embed(queries()[:b])
    for _ in range(3):
        mgr.search(queries(), ["task"] * BATCH)
    ms = timed(lambda: mgr.search(queries(), ["task"] * BATCH), reps)
    embed_ms = timed(lambda: emb.embed(queries()), max(5, reps // 2))
    cached = queries()
    mgr.search(cached, ["task"] * BATCH)
    search_ms = timed(lambda: mgr.search(cached, ["task"] * BATCH), reps)  # cache hits: search + Eq. 6 only
    mgr.close()
    line(
        n=n,
        method="e2e",
        p50_ms=round(float(np.percentile(ms, 50)), 3),
        p99_ms=round(float(np.percentile(ms, 99)), 3),
        recall_at_1=None,
        recall_at_16=None,
        reps=reps,
        embedder="minilm",
        embed_only_p50_ms=round(float(np.percentile(embed_ms, 50)), 3),
        search_diversify_p50_ms=round(float(np.percentile(search_ms, 50)), 3),
        search_diversify_p99_ms=round(float(np.percentile(search_ms, 99)), 3),
        note="16 new queries: MiniLM embed + micro-batched search + Eq.6 diversification",
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="20000,100000,1000000")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--num_queries", type=int, default=320)
    p.add_argument("--leaves_to_search_frac", type=float, default=IndexConfig.leaves_to_search_frac)
    p.add_argument("--reorder", type=int, default=IndexConfig.reorder)
    p.add_argument("--e2e_n", type=int, default=20000)
    p.add_argument("--e2e_reps", type=int, default=50)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    cfg = IndexConfig(leaves_to_search_frac=a.leaves_to_search_frac, reorder=a.reorder)
    for n in [int(s) for s in a.sizes.split(",") if s]:
        bench_size(n, rng, a.num_queries, cfg, a.reps)
    if a.e2e_n:
        centers = rng.standard_normal((max(16, a.e2e_n // 100), DIM)).astype(np.float32)
        bench_e2e(a.e2e_n, rng, centers / np.linalg.norm(centers, axis=1, keepdims=True), a.e2e_reps)


if __name__ == "__main__":
    main()
