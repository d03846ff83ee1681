"""ExperienceManager (SPEC §5-6): the one object the trainer talks to.

* Search: :meth:`search` runs in the calling thread, in micro-batches of ``batch`` queries: embed (LRU cache) ->
  index search under the reader lock -> under the writer lock, Eq. 6 re-rank + usage stats, query by query in
  order. (The trainer drives the manager this way, at fixed points of the step, for determinism;
  ``launch.threaded_manager.ThreadedExperienceManager`` adds the batcher and consumer threads of a
  serving setting.)
* Writes (extractor ops, merges, outcomes, training marks) take the writer lock, so a search sees either all or none
  of a mutation.
* Distillation: :meth:`distill` turns finished episodes into ``extractor_fn(prompts) -> responses`` calls (the
  sampler in the trainer, a plain callable in tests), parses and applies the ops.
  ``ops_submitted == ops_applied + ops_returned + ops_rejected`` always holds. A response is a
  plain string or a :class:`~comprl_jax.experience.sample.Generation` (its token ids and behaviour logprobs then
  travel with the entries it creates: they are the extractor's off-policy training sample).
* Read-only searches (``record=False``, e.g. evaluation) neither touch usage stats nor draw from the RNG, so they
  leave the bank and the training run exactly as they found them.
* Extractor buffer: :meth:`record_outcome` / :meth:`pop_extractor_batch` / :meth:`mark_trained` (SPEC §3, Eq. 7).
* :meth:`save` / :meth:`load` persist everything (see ``persist.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import json
import time
from collections.abc import Callable, Sequence

import numpy as np

from comprl_jax.experience import merge as merge_lib
from comprl_jax.experience.bank import ApplyResult, BankConfig, Entry, ExperienceBank
from comprl_jax.experience.buffer import BufferConfig, ExtractorBatch, ExtractorBuffer
from comprl_jax.experience.ops import distill_prompt, parse_ops, parse_refine, refine_prompt
from comprl_jax.experience.retrieval import EmbedCache, RetrievalConfig, diversify, format_experience
from comprl_jax.experience.sample import Generation, record_of, text_of
from comprl_jax.runtime.fields import check, from_section

EmbedFn = Callable[[list[str]], np.ndarray]
ExtractorFn = Callable[[list[str]], "list[str | Generation]"]


@dataclasses.dataclass(frozen=True)
class ManagerConfig:
    """Config section ``manager`` (SPEC §5 "ExperienceManager"): a wave's queries are embedded in one call
    (``embed_workers`` concurrent embedding calls at most) and their candidates searched in micro-batches of
    ``query_batch`` on ``search_workers`` threads.

    Attributes (not config keys): ``t_max_s`` the threaded serving manager's micro-batch wait (the paper's 1 ms;
    training searches a whole wave at once), ``cache_size`` the LRU of query embeddings, ``num_previous`` related
    lessons shown to a distillation call, ``distill_batch`` episodes per extractor call, ``seed`` the Eq. 6 dropout's.
    """

    query_batch: int = 16
    search_workers: int = 4
    embed_workers: int = 1
    t_max_s: float = 0.001
    cache_size: int = 1000
    num_previous: int = 5
    distill_batch: int = 8
    seed: int = 0

    def __post_init__(self):
        check(self.query_batch >= 1, "query_batch", "must be >= 1", self.query_batch)
        check(self.search_workers >= 1, "search_workers", "must be >= 1", self.search_workers)
        check(self.embed_workers >= 1, "embed_workers", "must be >= 1", self.embed_workers)


@dataclasses.dataclass
class Retrieval:
    uids: list[int]
    texts: list[str]
    block: str  # formatted experience block for the actor's system message


@dataclasses.dataclass
class DistillRequest:
    task_id: str
    goal: str
    success: bool
    trajectory: str
    query: str  # the episode's retrieval query (key text when bank.key == "query")
    retrieved: Sequence[int] = ()  # uids the episode used; shown first among the previous lessons
    step: int = 0


class ExperienceManager:
    def __init__(
        self,
        embed_fn: EmbedFn,
        dim: int,
        extractor_fn: ExtractorFn | None = None,
        *,
        bank_cfg: BankConfig = BankConfig(),
        retrieval_cfg: RetrievalConfig = RetrievalConfig(),
        buffer_cfg: BufferConfig = BufferConfig(),
        cfg: ManagerConfig = ManagerConfig(),
        clock: Callable[[], float] = time.time,
        query_embed_fn: EmbedFn | None = None,
    ):
        """``embed_fn`` embeds entry keys (documents); ``query_embed_fn`` (default: the same) embeds retrieval
        queries, e.g. with Qwen3-Embedding's query instruction. With ``bank.key == "query"`` keys are queries."""
        self.embed_fn, self.extractor_fn, self.clock = embed_fn, extractor_fn, clock
        self.cfg, self.retrieval_cfg = cfg, retrieval_cfg
        self.bank = ExperienceBank(dim, bank_cfg)
        self.lock = self.bank.lock
        self.buffer = ExtractorBuffer(buffer_cfg)
        self.cache = EmbedCache(query_embed_fn or embed_fn, cfg.cache_size, cfg.embed_workers)
        self.rng = np.random.default_rng(cfg.seed)
        self.counts: collections.Counter = collections.Counter()
        self.refine_samples: dict[str, tuple[str, str, dict | None]] = {}
        self.num_refines = 0
        self.errors: list[str] = []
        self._search_pool: cf.ThreadPoolExecutor | None = (
            None  # cfg.search_workers index-search threads, made on use
        )

    @classmethod
    def with_embedder(cls, embedder, extractor_fn: ExtractorFn | None = None, **kwargs) -> ExperienceManager:
        """A manager over an ``Embedder`` object (``.dim``, ``.embed``, optional ``.embed_query``) or a name for
        ``get_embedder`` ("minilm")."""
        if isinstance(embedder, str):
            from comprl_jax.models.embedders import get_embedder

            embedder = get_embedder(embedder)
        query_fn = getattr(embedder, "embed_query", None)
        return cls(embedder.embed, embedder.dim, extractor_fn, query_embed_fn=query_fn, **kwargs)

    def close(self) -> None:
        """Stops the index-search threads, if any were started."""
        if self._search_pool is not None:
            self._search_pool.shutdown(wait=True)
            self._search_pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- search ------------------------------------------------------------------------------------
    def search(self, queries: Sequence[str], task_ids: Sequence[str], record: bool = True) -> list[Retrieval]:
        """Retrieves for each (query, task_id); see :meth:`search_sync` (the threaded manager batches callers)."""
        return self.search_sync(queries, task_ids, record)

    def search_sync(
        self, queries: Sequence[str], task_ids: Sequence[str], record: bool = True
    ) -> list[Retrieval]:
        """The pipeline in the calling thread, deterministic and thread-safe: the queries embedded in one call
        (through the LRU cache, in order), candidates searched in micro-batches of ``cfg.query_batch`` on ``cfg.search_workers``
        threads (read-only, under the reader lock), then each micro-batch's Eq. 6 re-rank and usage stats in order.

        ``record=False``: a read-only search (no usage stats, no RNG draw; Eq. 6 still sees the current stats).
        """
        if len(queries) != len(task_ids):
            raise ValueError(f"{len(queries)} queries but {len(task_ids)} task ids")
        if not queries:
            return []
        vecs = self.cache(list(queries))  # one ordered call: the cache's state never depends on thread timing
        b = self.cfg.query_batch
        spans = [(i, min(i + b, len(queries))) for i in range(0, len(queries), b)]

        def candidates(span):
            i, j = span
            return self._candidates(vecs[i:j], list(task_ids[i:j]))

        if self.cfg.search_workers > 1 and len(spans) > 1:
            if self._search_pool is None:
                self._search_pool = cf.ThreadPoolExecutor(
                    self.cfg.search_workers, thread_name_prefix="bank-search"
                )
            cands = list(self._search_pool.map(candidates, spans))
        else:
            cands = [candidates(span) for span in spans]
        out: list[Retrieval] = []
        for (i, j), c in zip(spans, cands, strict=True):
            out += self._pick(c, j - i, record)
        return out

    def _run_batch(self, queries: list[str], task_ids: list[str], record: bool = True) -> list[Retrieval]:
        """One micro-batch through the whole pipeline (the threaded manager's workers call this)."""
        return self._pick(self._candidates(self.cache(queries), task_ids), len(queries), record)

    def _candidates(self, vecs: np.ndarray, task_ids: list[str]) -> list[np.ndarray]:
        """Eq. 6's candidate uids per query, from its task's partition (read-only)."""
        by_task: dict[str, list[int]] = collections.defaultdict(list)
        for i, t in enumerate(task_ids):
            by_task[t].append(i)
        cands: list[np.ndarray] = [np.zeros(0, np.int64)] * len(task_ids)
        with self.lock.read():
            for t, rows in by_task.items():
                uids, _ = self.bank.search(t, vecs[rows], self.retrieval_cfg.candidates)
                for r, u in zip(rows, uids, strict=True):
                    cands[r] = u
        return cands

    def _pick(self, cands: list[np.ndarray], n: int, record: bool) -> list[Retrieval]:
        """Eq. 6 re-rank of one micro-batch's candidates, usage stats and the RNG draw (writer lock, in order)."""
        rc = self.retrieval_cfg
        out = []
        with self.lock.write() if record else self.lock.read():
            now = float(self.clock())
            for u in cands:
                live = [int(x) for x in u if x >= 0 and int(x) in self.bank.entries]
                ents = [self.bank.entries[x] for x in live]
                pick = diversify(
                    [e.retrievals for e in ents],
                    [e.last_retrieved for e in ents],
                    now,
                    rc,
                    self.rng if record else None,
                )
                chosen = [live[p] for p in pick]
                if record:
                    self.bank.touch(chosen, now)
                texts = [self.bank.entries[x].text for x in chosen]
                out.append(Retrieval(chosen, texts, format_experience(texts)))
            if record:
                self.counts["searches"] += n
        return out

    # -- extractor ops -----------------------------------------------------------------------------
    def previous_lessons(self, task_id: str, query: str, first: Sequence[int] = ()) -> list[int]:
        """Uids shown as "previous lessons": ``first`` (still live), then the nearest entries to ``query``."""
        vec = self.cache([query])
        with self.lock.read():
            part = self.bank.part(task_id)
            shown = [
                int(u)
                for u in first
                if u in self.bank.entries and self.bank.part(self.bank.entries[u].task_id) == part
            ]
            uids, _ = self.bank.search(task_id, vec, self.cfg.num_previous + len(shown))
            for u in uids[0].tolist():
                if u >= 0 and u not in shown and len(shown) < self.cfg.num_previous:
                    shown.append(u)
        return shown[: self.cfg.num_previous]

    def embed_keys(self, texts: Sequence[str], query: bool) -> list[np.ndarray]:
        """Key embeddings of new entries: the entry text (``bank.key == "content"``) or the episode's query."""
        if not texts:
            return []
        vecs = self.cache(list(texts)) if query else self.embed_fn(list(texts))
        return list(np.asarray(vecs, np.float32))

    def apply_output(
        self,
        task_id: str,
        response: str | Generation,
        shown: Sequence[int],
        *,
        step: int,
        prompt: str = "",
        kind: str = "distill",
        query: str | None = None,
    ) -> ApplyResult:
        """Parses one extractor output and applies its ops atomically; every op is counted."""
        max_chars = self.bank.cfg.max_entry_chars
        tokens, response = record_of(response), text_of(response)
        res = parse_ops(response, len(shown), max_chars)
        key_query = self.bank.cfg.key == "query" and query is not None
        vecs = self.embed_keys([query if key_query else op.new_memory for op in res.ops], key_query)
        with self.lock.write():
            out = self.bank.apply_ops(
                task_id,
                res.ops,
                list(shown),
                vecs,
                step=step,
                prompt=prompt,
                response=response,
                kind=kind,
                key_text=query,
                tokens=tokens,
            )
            out.rejected.update(res.rejected)
            self.counts["ops_submitted"] += res.num_items
            self.counts["ops_applied"] += len(out.added)
            self.counts["ops_returned"] += res.num_returns
            self.counts["ops_rejected"] += sum(out.rejected.values())
            self.counts.update({f"rejected_{k}": v for k, v in out.rejected.items()})
        return out

    def distill(self, requests: Sequence[DistillRequest]) -> list[ApplyResult]:
        """One batched extractor call over finished episodes, then their ops (synchronous):
        :meth:`distill_prompts`, the manager's extractor_fn, :meth:`apply_distilled`."""
        if self.extractor_fn is None:
            raise ValueError("distill needs an extractor_fn")
        shown, prompts = self.distill_prompts(requests)
        return self.apply_distilled(requests, shown, prompts, list(self.extractor_fn(prompts)))

    def distill_prompts(self, requests: Sequence[DistillRequest]) -> tuple[list[list[int]], list[str]]:
        """The prompts of a distillation call (reads the bank: the lessons each request is shown) and the uids
        shown per request. Split from :meth:`apply_distilled` so that the generation between them can run in the
        background while the bank stays as it is (the trainer applies the ops at a fixed point later)."""
        shown, prompts = [], []
        max_chars = self.bank.cfg.max_entry_chars
        for r in requests:
            s = self.previous_lessons(r.task_id, r.query, r.retrieved)
            with self.lock.read():
                texts = [self.bank.entries[u].text if u in self.bank.entries else "" for u in s]
            shown.append(s)
            prompts.append(distill_prompt(r.goal, r.success, r.trajectory, texts, max_chars))
        return shown, prompts

    def apply_distilled(
        self,
        requests: Sequence[DistillRequest],
        shown: Sequence[Sequence[int]],
        prompts: Sequence[str],
        responses: Sequence[str | Generation],
    ) -> list[ApplyResult]:
        """The ops of a distillation call's ``responses`` (str or Generation each, one per prompt), in order."""
        if len(responses) != len(prompts):
            raise ValueError(f"extractor_fn returned {len(responses)} responses for {len(prompts)} prompts")
        return [
            self.apply_output(r.task_id, resp, s, step=r.step, prompt=p, query=r.query)
            for r, s, p, resp in zip(requests, shown, prompts, responses, strict=True)
        ]

    def merge(self, step: int) -> dict:
        """One periodic merge pass over every partition (SPEC §4)."""
        if self.extractor_fn is None:
            raise ValueError("merge needs an extractor_fn")
        stats = merge_lib.merge_bank(
            self.bank, self.embed_keys, self.extractor_fn, step, self.bank.cfg.merge_chunk
        )
        with self.lock.write():
            self.counts.update({f"merge_{k}": v for k, v in stats.items()})
            self.counts["merge_passes"] += 1
        return stats

    def dedup(self, threshold: float) -> int:
        """One deduplication pass over the whole bank (:meth:`ExperienceBank.dedup`); the number removed."""
        with self.lock.write():
            n = self.bank.dedup(threshold)
            self.counts["dedup_passes"] += 1
            self.counts["dedup_removed"] += n
        return n

    def refine(self, question: str, situation: str, task_id: str) -> tuple[str | None, str, list[int]]:
        """Search & ask: retrieve for ``question``, let the extractor rewrite the hit for the situation.

        Returns (answer or None when unparsable, sample key for :meth:`record_refine_outcome`, retrieved uids).
        """
        return self.refine_many([(question, situation, task_id)])[0]

    def refine_many(
        self,
        asks: Sequence[tuple[str, str, str]],
        record: bool = True,
        extractor_fn: ExtractorFn | None = None,
    ) -> list[tuple[str | None, str | None, list[int]]]:
        """:meth:`refine` for ``(question, situation, task_id)`` triples: one search batch, one extractor call.

        ``record=False`` (evaluation): a read-only search and no training sample (the key is None).
        ``extractor_fn`` overrides the manager's (e.g. evaluation's own PRNG stream).
        """
        fn = extractor_fn or self.extractor_fn
        if fn is None:
            raise ValueError("refine needs an extractor_fn")
        if not asks:
            return []
        hits = self.search([a[0] for a in asks], [a[2] for a in asks], record=record)
        prompts = [refine_prompt(q, sit, h.texts) for (q, sit, _), h in zip(asks, hits, strict=True)]
        responses = list(fn(prompts))
        out = []
        with self.lock.write():
            for prompt, response, hit in zip(prompts, responses, hits, strict=True):
                key = None
                if record:
                    key = f"refine:{self.num_refines}"
                    self.num_refines += 1
                    self.refine_samples[key] = (prompt, text_of(response), record_of(response))
                out.append((parse_refine(text_of(response)), key, hit.uids))
        return out

    # -- extractor training buffer -----------------------------------------------------------------
    def record_outcome(
        self, uids: Sequence[int], success: bool, bonus: float = 0.0, guided: bool = True
    ) -> None:
        """One guided trajectory that used ``uids`` finished: r = +1 on success, -1 on failure, plus ``bonus`` (the
        actor-critic score s of SPEC §7: the reward becomes s + r), once for each extractor call that wrote any of
        the entries (one call is one sample, SPEC §3: a trajectory guided by two entries of one call counts once).
        ``guided=False``: the actor-critic rejected the entries and the episode ran without them, so they get s
        alone (no r from an episode they did not guide)."""
        r = ((1.0 if success else -1.0) if guided else 0.0) + float(bonus)
        with self.lock.write():
            samples: dict[str, Entry | None] = {}
            for u in dict.fromkeys(int(x) for x in uids):
                e = self.bank.entries.get(u)
                # An entry gone since retrieval (none in the synchronous step: nothing mutates the bank between
                # the rollout's retrievals and this) keeps only a sample already waiting under its own key.
                key = ExperienceBank.sample_key(e) if e is not None else f"entry:{u}"
                if samples.get(key) is None:
                    samples[key] = e
            for key, e in samples.items():
                if key in self.buffer.samples:
                    self.buffer.add_reward(key, r)
                elif e is not None and e.prompt:
                    self.buffer.add_reward(
                        key, r, e.prompt, e.response, e.train_count, e.last_trained, e.tokens
                    )
                else:
                    self.counts["outcome_without_sample"] += 1

    def record_refine_outcome(self, key: str, success: bool) -> None:
        with self.lock.write():
            if key in self.buffer.samples:
                self.buffer.add_reward(key, 1.0 if success else -1.0)
            elif key in self.refine_samples:
                p, resp, tokens = self.refine_samples.pop(key)
                self.buffer.add_reward(key, 1.0 if success else -1.0, p, resp, tokens=tokens)
            else:
                raise KeyError(f"unknown refine sample key {key!r}")

    def pop_extractor_batch(self, step: int) -> ExtractorBatch | None:
        """The next full batch for an extractor update in trainer step ``step`` (Eq. 7's t, counted in trainer
        steps as the released code's ``global_step``), or None."""
        with self.lock.write():
            batch = self.buffer.pop_batch(step)
            if batch is not None:  # cumulative (bank/zero_weight_samples): the Eq. 7 cooldown acting
                self.counts["zero_weight_samples"] += int(np.sum(batch.weights == 0))
            return batch

    def mark_trained(self, batch: ExtractorBatch, step: int) -> None:
        """After an extractor update in trainer step ``step`` on ``batch``: bump c_train and set t_last on every
        live entry of each sample with w > 0 (all entries of one call alike)."""
        keys = ExtractorBuffer.trained_keys(batch)
        with self.lock.write():
            uids = [u for k in keys if not k.startswith("refine:") for u in self.bank.uids_of_sample(k)]
            self.bank.mark_trained(sorted(uids), step)

    # -- misc --------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        with self.lock.read():
            self.bank.check_invariants()
            c = self.counts
            assert c["ops_submitted"] == c["ops_applied"] + c["ops_returned"] + c["ops_rejected"], dict(c)

    def save(self, path: str) -> None:
        from comprl_jax.experience.persist import save_manager

        save_manager(self, path)

    def load(self, path: str) -> None:
        """Replaces this manager's state with the store at ``path`` (configs must match the saved ones)."""
        from comprl_jax.experience.persist import load_manager

        load_manager(self, path)

    @classmethod
    def restore(cls, path: str, embed_fn: EmbedFn, extractor_fn: ExtractorFn | None = None, **kwargs):
        """A new manager built from the configs saved at ``path``, then loaded (``kwargs``: e.g. clock)."""
        from comprl_jax.experience.persist import saved_configs

        configs, dim = saved_configs(path)
        mgr = cls(embed_fn, dim, extractor_fn, **configs_from_dict(upgrade_configs(configs)), **kwargs)
        mgr.load(path)
        return mgr

    def summary(self) -> dict:
        """Small JSON-able summary of the store (sizes and counters: logs, notebooks)."""
        with self.lock.read():
            return {
                "entries": len(self.bank.entries),
                "next_uid": self.bank.next_uid,
                "op_log_len": len(self.bank.op_log),
                "buffer": len(self.buffer),
                "counts": dict(self.counts),
            }

    def configs(self) -> dict:
        """The store's configs as plain dicts (:func:`configs_from_dict` builds them back)."""
        return {
            "bank": dataclasses.asdict(self.bank.cfg),
            "retrieval": dataclasses.asdict(self.retrieval_cfg),
            "buffer": dataclasses.asdict(self.buffer.cfg),
            "manager": dataclasses.asdict(self.cfg),
        }

    def state_dict(self) -> dict:
        """The whole store, consistent (taken under the writer lock after in-flight index builds finish):
        ``bank`` (:meth:`ExperienceBank.state_dict`), ``buffer``, ``counts``, ``rng_state`` (numpy PCG64 state),
        ``refine_samples``, ``num_refines``, ``dim`` and ``configs``. ``persist.save_manager`` writes it."""
        self.bank.wait_for_builds()  # outside the lock: a build publishes under the writer lock
        with self.lock.write():
            return {
                "dim": self.bank.dim,
                "configs": self.configs(),
                "bank": self.bank.state_dict(),
                "buffer": self.buffer.state_dict(),
                "counts": dict(self.counts),
                "rng_state": self.rng.bit_generator.state,
                "refine_samples": dict(self.refine_samples),
                "num_refines": self.num_refines,
            }

    def load_state_dict(self, state: dict) -> None:
        """Replaces bank, buffer, RNG and counters with a :meth:`state_dict`; the bank, retrieval and buffer
        configs must equal this manager's (:meth:`restore` builds a manager from the saved ones)."""
        if state["dim"] != self.bank.dim:
            raise ValueError(f"store dim {state['dim']} != manager dim {self.bank.dim}")
        mine = json.loads(json.dumps(self.configs()))
        saved = upgrade_configs(state["configs"])
        for name in ("bank", "retrieval", "buffer"):
            # a field added since the store was written is not compared (its default reproduces the old store),
            # nor one that schedules the run rather than shapes the store (_NOT_COMPARED)
            same = _NOT_COMPARED.get(name, ())
            diff = sorted(
                k
                for k in mine[name]
                if k in saved[name] and k not in same and mine[name][k] != saved[name][k]
            )
            window = _saved_window(state["configs"]["retrieval"]) if name == "retrieval" else None
            if window is not None and window != self.retrieval_cfg.window:
                diff.append("window")
            if diff:
                raise ValueError(
                    f"saved {name} config differs from this manager's in {diff} "
                    "(use ExperienceManager.restore to take the saved configs)"
                )
        with self.lock.write():
            self.bank.load_state_dict(state["bank"])
            self.counts = collections.Counter(state["counts"])
            self.rng.bit_generator.state = state["rng_state"]
            # (prompt, response, token record); stores written before token records were kept have pairs.
            self.refine_samples = {k: (*v, None)[:3] for k, v in state["refine_samples"].items()}
            self.num_refines = int(state["num_refines"])
            self.buffer.load_state_dict(state["buffer"])


_SECTIONS = {  # section -> (its dataclass, ExperienceManager's keyword)
    "bank": (BankConfig, "bank_cfg"),
    "retrieval": (RetrievalConfig, "retrieval_cfg"),
    "buffer": (BufferConfig, "buffer_cfg"),
    "manager": (ManagerConfig, "cfg"),
}


# Fields renamed since older stores wrote their configs (issue 29: a config section is its dataclass's arguments):
# (section, old field) -> (section, field).
_RENAMED = {
    ("retrieval", "top_k"): ("retrieval", "k"),
    ("retrieval", "num_candidates"): ("retrieval", "candidates"),
    ("manager", "batch"): ("manager", "query_batch"),
    ("manager", "workers"): ("manager", "search_workers"),
    ("manager", "merge_chunk"): ("bank", "merge_chunk"),
}


# Config fields a resumed run may change (``--allow_config_change``) without the store meaning something else: when
# merges run, the offline build, the embedder's name (its dim is checked), and the actor's search & ask budget.
_NOT_COMPARED = {
    "bank": ("merge", "merge_every", "merge_chunk", "offline", "offline_build_steps", "offline_dedup"),
    "retrieval": ("embedder", "search_and_ask", "search_and_ask_max", "search_and_ask_guided_only")
    # the window is compared as the one Eq. 6 uses (RetrievalConfig.window), whichever clock field holds it
    + ("clock", "window_steps", "window_s"),
}


def _saved_window(retrieval: dict) -> float | None:
    """Eq. 6's window a store's retrieval config used (None: not recorded)."""
    if "window" in retrieval:  # written before the clock was a field
        return float(retrieval["window"])
    if "clock" not in retrieval:
        return None
    return float(retrieval["window_s"] if retrieval["clock"] == "wall" else retrieval["window_steps"])


def upgrade_configs(configs: dict) -> dict:
    """A store's saved configs (``meta.json``) in today's field names (a copy): renamed fields moved, an unset
    dedup threshold (``None``) as 0 (off), and ``retrieval.window`` (from before the clock was a field) as the
    window of a ``"wall"`` clock (the same number Eq. 6 used: the manager's clock is its own argument)."""
    out = {name: dict(section) for name, section in configs.items()}
    for (sec, old), (new_sec, new) in _RENAMED.items():
        if old in out.get(sec, {}):
            out.setdefault(new_sec, {}).setdefault(new, out[sec].pop(old))
    if out.get("bank", {}).get("dedup_threshold", 0.0) is None:
        out["bank"]["dedup_threshold"] = 0.0
    r = out.get("retrieval", {})
    if (
        "window" in r
    ):  # the window was Eq. 6's in the manager's clock units: as a wall window it is the same number
        r["clock"], r["window_s"] = "wall", float(r.pop("window"))
    return out


def configs_from_dict(d) -> dict:
    """Keyword arguments for :class:`ExperienceManager` (``bank_cfg``, ``retrieval_cfg``, ``buffer_cfg``, ``cfg``)
    from a plain/ConfigDict mapping ``{"bank": {..., "index": {...}}, "retrieval": {...}, ...}``, each section its
    dataclass's arguments. Unknown sections or keys raise ValueError naming the dotted key."""
    out = {}
    for section in d.keys():
        if section not in _SECTIONS:
            raise ValueError(f"unknown experience config section {section!r}; known: {sorted(_SECTIONS)}")
        cls, name = _SECTIONS[section]
        out[name] = from_section(cls, d[section], section)
    return out
