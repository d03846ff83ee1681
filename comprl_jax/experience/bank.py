"""The experience bank M (SPEC §4): entries, task partitions, FIFO cap, optional dedup, usage stats, ordered op log.

Every mutation goes through four primitives (:meth:`ExperienceBank.add`, ``remove``, ``touch``, ``mark_trained``),
and each appends one JSON-able record to ``op_log``. Replaying the log on an empty bank with the same deterministic
``embed_fn`` (:meth:`ExperienceBank.replay`) rebuilds the same bank, which is what multi-process runs need (SPEC §6):
process 0 owns the bank and broadcasts the records, or every process applies the same records in the same order.

The bank itself is not thread-safe; :class:`RWLock` and the :class:`~comprl_jax.experience.manager.ExperienceManager`
put readers (search) under a shared lock and every mutation under the exclusive lock.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np

from comprl_jax.experience.index import IndexConfig, PartitionIndex
from comprl_jax.experience.ops import Op
from comprl_jax.runtime.fields import check

PARTITIONS = ("task", "shared")
SHARED = "<shared>"  # the one partition of a shared bank


@dataclasses.dataclass
class Entry:
    """One lesson. ``text`` is ``<title>…</title><content>…</content>``; the key embedding lives in the index."""

    uid: int
    task_id: str
    text: str
    key_text: str  # what was embedded (entry text, or the episode query when bank.key == "query")
    created_step: int
    retrievals: int = 0
    last_retrieved: float | None = None  # clock time of the last retrieval
    train_count: int = 0  # updates that trained this entry's sample (its call's: every entry of a call alike)
    last_trained: int | None = None  # trainer step of the last update that trained this entry's sample
    # The extractor call that wrote the entry (a distillation, merge or seed call). Every entry of one call shares
    # one training sample (SPEC §3: the released code keys samples by request_id). -1: a store from before calls
    # were recorded, where each entry is its own sample.
    call: int = -1
    prompt: str = ""  # extractor prompt/response that produced the entry = its training sample
    response: str = ""
    kind: str = "distill"  # distill | merge | refine | seed
    tokens: dict | None = None  # the sample's ids + behaviour logprobs (experience.sample.Generation.record)


BANK_KEYS = ("content", "query")


@dataclasses.dataclass(frozen=True)
class BankConfig:
    """Config section ``bank`` (SPEC §4-5, §8).

    Attributes:
      capacity: entries at most, FIFO over the whole bank.
      key: what an entry is embedded by: ``"content"`` (paper) | ``"query"`` (the released code: the episode's query).
      dedup_threshold: an op whose cosine with a live entry of its partition is >= this is rejected (0 = off).
      max_entry_chars: an entry's text is cut to this.
      merge / merge_every / merge_chunk: the periodic merge (every ``merge_every`` trainer steps, ``merge_chunk``
        entries per extractor call).
      partition: ``"shared"``: one bank for every task of a mixture (the paper's: experience transfers; entries still
        record their task); ``"task"``: one partition per task id, search and merge inside it.
      offline / offline_build_steps / offline_dedup: Offline Exp. (SPEC §8): rollout rounds of the frozen actor and
        extractor build the bank before step 0, merged once, then deduplicated (key cosine >= offline_dedup with an
        older entry of its partition; 0 = no pass; 0.95 is ours, the paper gives none) and fixed.
      index: the vector index (not a config key: the trainer picks it).
    """

    capacity: int = 20_000
    key: str = "content"
    dedup_threshold: float = 0.0
    max_entry_chars: int = 2_000
    merge: bool = True
    merge_every: int = 5
    merge_chunk: int = 5
    partition: str = "task"
    offline: bool = False
    offline_build_steps: int = 5
    offline_dedup: float = 0.95
    index: IndexConfig = IndexConfig()

    def __post_init__(self):
        check(self.capacity >= 1, "capacity", "must be >= 1", self.capacity)
        check(self.key in BANK_KEYS, "key", f"must be one of {BANK_KEYS}", self.key)
        check(self.partition in PARTITIONS, "partition", f"must be one of {PARTITIONS}", self.partition)
        check(
            0.0 <= self.dedup_threshold <= 1.0,
            "dedup_threshold",
            "must be in [0, 1] (0 = off)",
            self.dedup_threshold,
        )
        check(self.merge_every >= 1, "merge_every", "must be >= 1", self.merge_every)
        check(self.merge_chunk >= 1, "merge_chunk", "must be >= 1", self.merge_chunk)
        check(self.offline_build_steps >= 1, "offline_build_steps", "must be >= 1", self.offline_build_steps)
        check(
            0.0 <= self.offline_dedup <= 1.0,
            "offline_dedup",
            "must be in [0, 1] (0 = no pass)",
            self.offline_dedup,
        )


class RWLock:
    """Writer-preferring readers-writer lock (a waiting writer blocks new readers, so writers cannot starve)."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.contextmanager
    def read(self):
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self):
        with self._cond:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


@dataclasses.dataclass
class ApplyResult:
    added: list[int]
    removed: list[int]
    rejected: collections.Counter


class ExperienceBank:
    """Entries by uid (insertion order = uid order = FIFO order) plus one :class:`PartitionIndex` per partition
    (a task id, or :data:`SHARED` for every task; ``BankConfig.partition``). Methods take task ids; the bank maps
    them to partitions with :meth:`part`."""

    def __init__(self, dim: int, cfg: BankConfig = BankConfig(), lock: RWLock | None = None):
        self.dim, self.cfg = dim, cfg
        self.lock = lock or RWLock()
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self.indexes: dict[str, PartitionIndex] = {}
        self.next_uid = 0
        self.next_call = 0
        self.op_log: list[dict] = []
        self.counts: collections.Counter = collections.Counter()

    # -- primitives (caller holds the writer lock) --------------------------------------------------
    def _log(self, rec: dict) -> None:
        rec["seq"] = len(self.op_log)
        self.op_log.append(rec)

    def part(self, task_id: str) -> str:
        """The partition (index key) that ``task_id``'s entries live in."""
        return SHARED if self.cfg.partition == "shared" else task_id

    def new_call(self) -> int:
        """A fresh extractor-call id for the entries one call writes (caller holds the writer lock)."""
        self.next_call += 1
        return self.next_call - 1

    @staticmethod
    def sample_key(e: Entry) -> str:
        """The training-buffer key of ``e``'s sample: its call's (``"call:<id>"``), or ``"entry:<uid>"`` for an
        entry from a store without call ids."""
        return f"call:{e.call}" if e.call >= 0 else f"entry:{e.uid}"

    def uids_of_sample(self, key: str) -> list[int]:
        """Live entries whose sample is ``key`` (caller holds a lock)."""
        kind, _, n = key.partition(":")
        if kind == "entry":
            return [int(n)] if int(n) in self.entries else []
        if kind == "call":
            return [u for u, e in self.entries.items() if e.call == int(n)]
        raise ValueError(f"not an entry sample key: {key!r}")

    def _index(self, task_id: str) -> PartitionIndex:
        p = self.part(task_id)
        if p not in self.indexes:
            self.indexes[p] = PartitionIndex(self.dim, self.cfg.index, writer_lock=self.lock.write)
        return self.indexes[p]

    def add(
        self,
        task_id: str,
        text: str,
        vec: np.ndarray,
        *,
        step: int,
        key_text: str | None = None,
        prompt: str = "",
        response: str = "",
        kind: str = "distill",
        tokens: dict | None = None,
        evict: bool = True,
        call: int | None = None,
    ) -> int:
        """Adds one entry (no validation beyond the vector shape) and, unless ``evict=False``, evicts the oldest
        entries past capacity (``apply_ops`` defers eviction to the end so an add cannot evict a later op's target).
        ``call``: the extractor call that wrote it (:meth:`new_call`; None: a call of its own).
        """
        vec = np.asarray(vec, np.float32).reshape(-1)
        if vec.shape != (self.dim,):
            raise ValueError(f"embedding for task {task_id!r} has shape {vec.shape}, expected ({self.dim},)")
        uid = self.next_uid
        self.next_uid += 1
        key_text = text if key_text is None else key_text
        call = self.new_call() if call is None else int(call)
        self.next_call = max(self.next_call, call + 1)
        self.entries[uid] = Entry(
            uid,
            task_id,
            text,
            key_text,
            int(step),
            call=call,
            prompt=prompt,
            response=response,
            kind=kind,
            tokens=tokens,
        )
        self._index(task_id).add(uid, vec)
        self._log(
            {
                "op": "add",
                "uid": uid,
                "task_id": task_id,
                "text": text,
                "key_text": key_text,
                "step": int(step),
                "call": call,
                "prompt": prompt,
                "response": response,
                "kind": kind,
                "tokens": tokens,
            }
        )
        self.counts[f"added_{kind}"] += 1
        if evict:
            self.evict()
        return uid

    def evict(self) -> None:
        """FIFO: removes the oldest entries while the bank is over capacity."""
        while len(self.entries) > self.cfg.capacity:
            self.remove(next(iter(self.entries)), "fifo")

    def remove(self, uid: int, reason: str) -> None:
        entry = self.entries.pop(uid)
        self.indexes[self.part(entry.task_id)].remove(uid)
        self._log({"op": "remove", "uid": uid, "reason": reason})
        self.counts[f"removed_{reason}"] += 1

    def touch(self, uids: Sequence[int], now: float) -> None:
        """Records one retrieval of each uid at clock time ``now``."""
        uids = [int(u) for u in uids if u in self.entries]
        for u in uids:
            e = self.entries[u]
            e.retrievals += 1
            e.last_retrieved = float(now)
        if uids:
            self._log({"op": "touch", "uids": uids, "now": float(now)})

    def mark_trained(self, uids: Sequence[int], step: int) -> None:
        """Records that ``uids``' samples were trained on in extractor update ``step`` (Eq. 7's t)."""
        uids = [int(u) for u in uids if u in self.entries]
        for u in uids:
            self.entries[u].train_count += 1
            self.entries[u].last_trained = int(step)
        if uids:
            self._log({"op": "train", "uids": uids, "step": int(step)})

    # -- extractor ops -----------------------------------------------------------------------------
    def apply_ops(
        self,
        task_id: str,
        ops: Sequence[Op],
        shown: Sequence[int],
        vecs: Sequence[np.ndarray],
        *,
        step: int,
        prompt: str = "",
        response: str = "",
        kind: str = "distill",
        key_text: str | None = None,
        tokens: dict | None = None,
    ) -> ApplyResult:
        """Applies parsed ops atomically (caller holds the writer lock).

        Args:
          task_id: partition the ops write to.
          ops: validated ops from :func:`~comprl_jax.experience.ops.parse_ops` (targets 0-based into ``shown``).
          shown: uids of the "previous lessons" shown to the extractor, in the order shown.
          vecs: key embedding of each op's new entry, [D] each, aligned with ``ops``.
          step, prompt, response, kind, tokens: recorded on every new entry (its training sample).
          key_text: embedded text when ``bank.key == "query"`` (else the entry text is the key).

        Every op is checked against the current bank first (targets removed since the prompt was built are
        "stale_target", near-duplicates "duplicate"); only then are the surviving ops applied.
        """
        rejected: collections.Counter = collections.Counter()
        keep: list[tuple[Op, np.ndarray]] = []
        for op, vec in zip(ops, vecs, strict=True):
            if op.function == "update":
                if any(t >= len(shown) for t in op.targets):
                    rejected["target_out_of_range"] += 1
                    continue
                if any(
                    self.entries.get(shown[t]) is None
                    or self.part(self.entries[shown[t]].task_id) != self.part(task_id)
                    for t in op.targets
                ):
                    rejected["stale_target"] += 1
                    continue
            elif self.cfg.dedup_threshold:
                v = np.asarray(vec, np.float32)
                best = -np.inf
                if self.part(task_id) in self.indexes:
                    best = float(self.indexes[self.part(task_id)].search(v[None], 1)[1][0, 0])
                # Also against adds kept earlier in this same op list (not in the index yet).
                best = max(
                    [best] + [float(v @ np.asarray(w, np.float32)) for o, w in keep if o.function == "add"]
                )
                if best >= self.cfg.dedup_threshold:
                    rejected["duplicate"] += 1
                    continue
            keep.append((op, vec))
        added, removed = [], []
        call = self.new_call() if keep else None  # one call, one training sample for all its entries
        for op, vec in keep:
            for t in op.targets:
                self.remove(shown[t], kind if kind == "merge" else "update")
                removed.append(shown[t])
            kt = key_text if self.cfg.key == "query" and key_text is not None else op.new_memory
            added.append(
                self.add(
                    task_id,
                    op.new_memory,
                    vec,
                    step=step,
                    key_text=kt,
                    prompt=prompt,
                    response=response,
                    kind=kind,
                    tokens=tokens,
                    evict=False,
                    call=call,
                )
            )
        self.evict()
        for r, c in rejected.items():
            self.counts[f"rejected_{r}"] += c
        return ApplyResult(added, removed, rejected)

    # -- reads (caller holds a reader lock) -------------------------------------------------------
    def search(self, task_id: str, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k uids [Q, k] (-1 padded) and dot-product scores [Q, k] within ``task_id``'s partition."""
        queries = np.asarray(queries, np.float32).reshape(-1, self.dim)
        p = self.part(task_id)
        if p not in self.indexes:
            return np.full((len(queries), k), -1, np.int64), np.full((len(queries), k), -np.inf, np.float32)
        return self.indexes[p].search(queries, k)

    def partition(self, task_id: str) -> list[int]:
        """Uids in ``task_id``'s partition, FIFO order."""
        p = self.part(task_id)
        return [u for u, e in self.entries.items() if self.part(e.task_id) == p]

    def vector(self, uid: int) -> np.ndarray:
        return self.indexes[self.part(self.entries[uid].task_id)].vector(uid)

    def dedup(self, threshold: float) -> int:
        """Removes near-duplicates (caller holds the writer lock): walking each partition oldest first, an entry
        whose key embedding has cosine >= ``threshold`` with an earlier kept one goes (reason "dedup"). Returns how
        many went."""
        removed = 0
        for p in sorted(self.indexes):
            uids = [u for u, e in self.entries.items() if self.part(e.task_id) == p]
            kept = np.zeros((len(uids), self.dim), np.float32)  # the kept keys so far, rows [0, n)
            n = 0
            for u in uids:
                v = np.asarray(self.vector(u), np.float32)
                if n and float(np.max(kept[:n] @ v)) >= threshold:
                    self.remove(u, "dedup")
                    removed += 1
                else:
                    kept[n] = v
                    n += 1
        self.counts["dedup_removed"] += removed
        return removed

    # -- state (caller holds the writer lock; persist.py writes / reads it as JSON + .npy + ScaNN folders) -------
    def state_dict(self) -> dict:
        """Everything the bank holds, as copies: ``entries`` (dicts of every :class:`Entry` field, uid order),
        ``embeddings`` ``[N, D]`` float32 (row i = entries[i]), ``next_uid``, ``next_call``, ``counts``, ``op_log``
        and ``partitions`` (``[{"task_id", "built": BuiltIndex | None}]``, sorted: the published searchers)."""
        entries = list(self.entries.values())
        emb = np.stack([self.vector(e.uid) for e in entries]) if entries else np.zeros((0, self.dim))
        return {
            "entries": [dataclasses.asdict(e) for e in entries],
            "embeddings": emb.astype(np.float32),
            "next_uid": self.next_uid,
            "next_call": self.next_call,
            "counts": dict(self.counts),
            "op_log": [dict(r) for r in self.op_log],
            "partitions": [{"task_id": t, "built": ix.built} for t, ix in sorted(self.indexes.items())],
        }

    def load_state_dict(self, state: dict) -> None:
        """Replaces the bank's contents with a :meth:`state_dict` (indexes rebuilt from the rows, published
        searchers restored as they were, no build triggered)."""
        entries = [Entry(**d) for d in state["entries"]]
        emb = np.asarray(state["embeddings"], np.float32)
        if emb.shape != (len(entries), self.dim):
            raise ValueError(
                f"bank state: embeddings of shape {emb.shape}, expected ({len(entries)}, {self.dim})"
            )
        self.entries = collections.OrderedDict((e.uid, e) for e in entries)
        self.indexes = {}
        rows: dict[str, list[int]] = collections.defaultdict(list)  # partition key -> rows
        for i, e in enumerate(entries):
            rows[self.part(e.task_id)].append(i)
        built = {p["task_id"]: p["built"] for p in state["partitions"]}
        for task_id in sorted(set(rows) | set(built)):
            r = rows.get(task_id, [])
            ix = self._index(task_id)
            ix.load_rows(np.array([entries[i].uid for i in r], np.int64), emb[r])
            if built.get(task_id) is not None:
                ix.set_built(built[task_id])
        self.next_uid = int(state["next_uid"])
        # stores from before call ids: the next call after any recorded one
        self.next_call = int(state.get("next_call", max([e.call + 1 for e in entries], default=0)))
        self.counts = collections.Counter(state["counts"])
        self.op_log = list(state["op_log"])

    def wait_for_builds(self) -> None:
        for idx in list(self.indexes.values()):
            idx.wait_for_build()

    def check_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant."""
        uids = list(self.entries)
        assert len(set(uids)) == len(uids) and uids == sorted(uids), "uids not unique/ordered"
        assert all(u < self.next_uid for u in uids), "uid >= next_uid"
        assert len(self.entries) <= self.cfg.capacity, "over capacity"
        assert sum(len(ix) for ix in self.indexes.values()) == len(self.entries), "index size != entry count"
        for u, e in self.entries.items():
            p = self.part(e.task_id)
            assert e.uid == u and u in self.indexes[p], f"entry {u} missing from index {p!r}"
            assert e.retrievals >= 0 and (e.last_retrieved is None) == (e.retrievals == 0), f"stats of {u}"
            assert e.train_count >= 0 and (e.last_trained is None) == (e.train_count == 0), (
                f"train stats of {u}"
            )
        assert [r["seq"] for r in self.op_log[-3:]] == list(range(len(self.op_log)))[-3:], "op log seq"

    # -- replay ------------------------------------------------------------------------------------
    def replay(self, records: Sequence[dict], embed_fn: Callable[[list[str]], np.ndarray]) -> None:
        """Applies op-log records (from another bank's ``op_log``) in order; uids must line up."""
        for rec in records:
            op = rec.get("op")
            if op == "add":
                if rec["uid"] != self.next_uid:
                    raise ValueError(
                        f"op log out of sync: record seq {rec.get('seq')} adds uid {rec['uid']}, "
                        f"bank expects {self.next_uid}"
                    )
                vec = np.asarray(embed_fn([rec["key_text"]]), np.float32)[0]
                self.add(
                    rec["task_id"],
                    rec["text"],
                    vec,
                    step=rec["step"],
                    key_text=rec["key_text"],
                    prompt=rec["prompt"],
                    response=rec["response"],
                    kind=rec["kind"],
                    tokens=rec.get("tokens"),
                    evict=False,  # evictions are replayed from their own "remove" records, in logged order
                    call=rec.get("call"),
                )
            elif op == "remove":
                if rec["uid"] not in self.entries:
                    raise ValueError(
                        f"op log out of sync: record seq {rec.get('seq')} removes unknown uid {rec['uid']}"
                    )
                self.remove(rec["uid"], rec["reason"])
            elif op == "touch":
                self.touch(rec["uids"], rec["now"])
            elif op == "train":
                self.mark_trained(rec["uids"], rec["step"])
            else:
                raise ValueError(f"unknown op-log record {op!r} at seq {rec.get('seq')}")
