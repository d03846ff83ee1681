"""The extractor side of the loop (SPEC §3-6), on top of :class:`~comprl_jax.experience.ExperienceManager`:
retrieval for guided rollouts, distillation of finished trajectories, periodic merge, entry rewards into the
extractor's training buffer, and the generation function the manager calls (the extractor's sampler).

Determinism: the trainer calls every mutating method at fixed points of a step and in a fixed order; the
generation key of the n-th extractor call is ``fold_in(key(seed), n)`` (n is checkpointed); the Eq. 6 clock counts
rollout steps by default (``retrieval.clock="step"``, window ``retrieval.window_steps``). A resumed run therefore
replays bit-identically. Evaluation uses read-only searches and its own PRNG stream, so it changes nothing here.

Every extractor call returns :class:`~comprl_jax.experience.sample.Generation`s: the sampled ids, the prompt ids
the sampler consumed, the behaviour logprobs and the extractor version (updates so far) that wrote them. They are
the extractor's off-policy training samples (CISPO's importance weight needs the writer's logprobs).
Overlap: ``distill_launch`` reads the prompts from the bank, reserves the call's key and starts the generation in a
background thread; ``distill_apply`` applies its ops later, on the trainer's thread (the trainer lets it run during
the next rollout, or only during the actor update: ``extractor.distill_overlap``). Jitted calls of the two
models overlap through async dispatch; calls on one sampler are serialised by its lock.

Multi-process (``multi_process=True``, set by the trainer from ``distributed.multi()``): every process holds an
identical manager and calls it identically.
Distillation then runs inline (the trainer dispatches the actor update first, so the device work still overlaps):
one thread issues every jitted call, in the same order on every process. Retrieval is exact search (the ScaNN
path is off: its k-means build is not guaranteed identical across processes); at the paper's capacity (20,000
entries) an exact search of a 16-query micro-batch is a few milliseconds of numpy. Identical banks + identical
queries + deterministic search = identical results on every process, so nothing needs to be broadcast; the
trainer checks the replicas' digests at every checkpoint.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from comprl_jax.experience import (
    BankConfig,
    DistillRequest,
    ExperienceManager,
    IndexConfig,
    ManagerConfig,
    RetrievalConfig,
)
from comprl_jax.experience.sample import Generation
from comprl_jax.rl.advantages import CRITIC_SCORES
from comprl_jax.roles.role_config import ExtractorConfig
from comprl_jax.rollout.episodes import Trajectory

_WORD = r"[a-z][a-z ,]{0,%d}"


def ops_regex(max_title: int = 20, max_content: int = 80, max_targets: int = 5) -> str:
    """Extractor output grammar for small constrained extractors: one op, an ``add`` or an ``update`` of up to
    ``max_targets`` previous lessons (one-digit indices, in the field order ``json.dumps`` writes) with one short
    lowercase lesson, or ``return``."""
    memory = (
        r'"new_memory": "'
        + f"<title>{_WORD % max_title}</title><content>{_WORD % max_content}</content>"
        + '"'
    )
    add = r'\{"function_name": "add", "parameters": \{' + memory + r"\}\}"
    targets = r"\[[1-9](, [1-9]){0," + str(max_targets - 1) + r"}\]"
    update = (
        r'\{"function_name": "update", "parameters": \{"target_idx": ' + targets + ", " + memory + r"\}\}"
    )
    ret = r'\{"function_name": "return"\}'
    return r"<answer>\[(" + add + "|" + update + "|" + ret + r")\]</answer>"


@dataclasses.dataclass
class PendingDistill:
    """A distillation whose generation runs in the background (:meth:`ExtractorTrack.distill_launch`): the
    requests, the uids each prompt showed, the prompts, and the future of the generations."""

    requests: list[DistillRequest]
    shown: list[list[int]]
    prompts: list[str]
    future: cf.Future


class ExtractorTrack:
    """Owns the ExperienceManager and the extractor's generation for it."""

    def __init__(
        self,
        extractor: ExtractorConfig,
        bank: BankConfig,
        retrieval: RetrievalConfig,
        manager: ManagerConfig,
        embedder: Any,
        sampler: Any,
        tokenizer: Any,
        seed: int,
        *,
        multi_process: bool = False,
    ):
        """The run config's ``extractor``, ``bank``, ``retrieval`` and ``manager`` sections (each its dataclass:
        they reach the manager as they are). ``multi_process``: identical replicas on every process
        (``distributed.multi()``): distillation runs inline on the main thread, exact search only, no background
        index builds."""
        self.cfg, self.clock = extractor, retrieval.clock
        self.sampler, self.tokenizer, self.seed = sampler, tokenizer, seed
        self.calls = 0  # extractor generation calls so far (keys are derived from it)
        self.version = 0  # extractor updates dispatched (the trained weights' version)
        # the version the sampler's copy holds: behind ``version`` while an update's refresh is deferred (the
        # sampler answers search & ask with the weights before it); generations are labelled with it
        self.sampler_version = 0
        self._now = 0.0
        self.search_ms: list[float] = []  # per retrieval batch (episode starts)
        self.ask_ms: list[float] = []  # per search & ask call (retrieval + the extractor's answer)
        self.inline = multi_process
        index = IndexConfig(scann_min_size=2**62, background=False) if self.inline else IndexConfig()
        self.mgr = ExperienceManager(
            embedder.embed,
            embedder.dim,
            self._extract,
            bank_cfg=dataclasses.replace(bank, index=index),
            retrieval_cfg=retrieval,
            buffer_cfg=extractor.buffer,
            cfg=dataclasses.replace(manager, seed=seed),
            clock=lambda: self._now,
            query_embed_fn=getattr(embedder, "embed_query", None),
        )
        self._constraint = sampler.regex_constraint(ops_regex()) if extractor.constrained else None
        self.sp = extractor.sampling
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="extractor-track")

    # -- the manager's extractor_fn --------------------------------------------------------------------
    def _extract(self, prompts: Sequence[str]) -> list[Generation]:
        """The training stream: the n-th call uses ``fold_in(key(seed + 7919), n)``."""
        if not prompts:
            return []
        key = jax.random.fold_in(jax.random.key(self.seed + 7919), self.calls)
        self.calls += 1
        return self.generate(prompts, key)

    def generate(self, prompts: Sequence[str], key, version: int | None = None) -> list[Generation]:
        """One batched extractor call: chat template, left-truncation to the context, constrained ops for tiny
        extractors. Returns the text and the exact token record of every response, labelled with ``version``
        (default: the sampler's version now)."""
        version = self.sampler_version if version is None else version
        tok = self.tokenizer
        ids = [tok.encode_user_prompt(p) for p in prompts]
        room = self.cfg.max_context - self.sp.max_new_tokens
        ids = [x[-room:] for x in ids]  # keep the end (the op format instructions) if a prompt is too long
        # extractor.rows_per_call rows per sampler call (its KV cache is rows x (prompt + max_new) slots); one
        # call keeps ``key`` itself, so the default (0 = all at once) samples exactly as a single call does.
        per = self.cfg.rows_per_call or max(len(ids), 1)
        chunks = [ids[i : i + per] for i in range(0, len(ids), per)]
        results = [
            self.sampler.generate(
                chunk,
                key if len(chunks) == 1 else jax.random.fold_in(key, i),
                self.sp,
                stop_strings=("</answer>",),
                constraint=self._constraint,
            )
            for i, chunk in enumerate(chunks)
        ]
        rows = [(res, b) for res, chunk in zip(results, chunks, strict=True) for b in range(len(chunk))]
        out = []
        for (res, b), prompt_ids in zip(rows, ids, strict=True):
            n = int(res.lengths[b])
            sampled = res.tokens[b, :n].tolist()
            out.append(
                Generation(
                    text=tok.decode(sampled, skip_special=True),
                    prompt_ids=tuple(int(i) for i in prompt_ids),
                    response_ids=tuple(int(i) for i in sampled),
                    logprobs=tuple(float(x) for x in res.logprobs[b, :n]),
                    version=version,
                )
            )
        return out

    # -- retrieval -------------------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """The Eq. 6 clock: the rollout step (``retrieval.clock="step"``) or wall seconds (``"wall"``)."""
        self._now = time.time() if self.clock == "wall" else float(step)

    def retrieve(
        self, task_ids: Sequence[str], queries: Sequence[str], record: bool = True
    ) -> list[tuple[str, tuple[int, ...]]]:
        """(experience block, entry uids) per query, searched in its task's partition (``bank.partition``).
        ``record=False``: read-only (evaluation)."""
        if not queries:
            return []
        t0 = time.perf_counter()
        got = self.mgr.search(list(queries), list(task_ids), record=record)
        if record:
            self.search_ms.append((time.perf_counter() - t0) * 1000.0)
        return [(r.block, tuple(r.uids)) for r in got]

    def ask_many(
        self, asks: Sequence[tuple[str, str, str]], record: bool = True, key=None
    ) -> list[tuple[str | None, str | None]]:
        """Search & ask (SPEC §5) for ``(question, situation, env_id)`` triples, one extractor call: the extractor
        rewrites the best hit for each actor's situation. Returns ``(answer or None, sample key or None)``.

        ``record=False`` (evaluation): read-only search, no training sample, and generation on ``key``'s own
        stream (the training stream's call counter does not move).
        """
        fn = None if record else (lambda prompts: self.generate(prompts, key))
        t0 = time.perf_counter()
        got = self.mgr.refine_many(list(asks), record=record, extractor_fn=fn)
        if record:
            self.ask_ms.append((time.perf_counter() - t0) * 1000.0)
        return [(answer, k) for answer, k, _ in got]

    # -- per-step bookkeeping ------------------------------------------------------------------------
    def record_outcomes(self, trajs: Sequence[Trajectory]) -> None:
        """SPEC §3: every guided trajectory gives +1 / -1 to each entry it used (plus the actor-critic score s when
        it judged the entry, SPEC §7; a rejected entry did not guide the episode and gets s = 0 alone), and to each
        search & ask refinement it received (that call is an extractor training sample too). Episodes that failed
        for infrastructure reasons say nothing and are skipped."""
        for t in trajs:
            if t.infra_failed:
                continue
            if t.spec.guided and t.spec.entry_uids:
                s = t.spec.critic_score
                # a rejected entry was dropped: the episode ran without it
                rejected = s is not None and s == CRITIC_SCORES["reject"]
                self.mgr.record_outcome(t.spec.entry_uids, t.success, s or 0.0, guided=not rejected)
            for key in t.ask_keys:
                self.mgr.record_refine_outcome(key, t.success)

    def distill_async(self, trajs: Sequence[Trajectory], step: int, every: bool = False) -> cf.Future:
        """Distils finished episodes and applies the ops in the background (the offline build; the trainer's
        steps use :meth:`distill_launch` / :meth:`distill_apply`); ``every``: all episodes, e.g. the offline
        build's free rollouts (never infra-failed ones)."""
        reqs = self._requests(trajs, step, every)
        if self.inline:
            fut: cf.Future = cf.Future()
            fut.set_result(self.mgr.distill(reqs))
            return fut
        return self._executor.submit(self.mgr.distill, reqs)

    def _requests(self, trajs: Sequence[Trajectory], step: int, every: bool) -> list[DistillRequest]:
        """This step's finished episodes to distil (``extractor.distill_from``, or all with ``every``; never
        infra-failed ones)."""
        return [
            DistillRequest(
                task_id=t.spec.task.env_id,
                goal=t.goal,
                success=t.success,
                trajectory=t.transcript_text(self.cfg.transcript_chars),
                query=t.query,
                retrieved=tuple(t.spec.entry_uids),
                step=step,
            )
            for t in trajs
            if (every or self.cfg.distill_from == "all" or t.spec.guided) and not t.infra_failed
        ]

    def distill_launch(self, trajs: Sequence[Trajectory], step: int) -> PendingDistill:
        """Producer-consumer distillation (SPEC §6; the release's memory manager distils in the background): the
        prompts are read from the bank now, the generation starts in the background (inline on several
        processes), and nothing changes the bank until :meth:`distill_apply` at the trainer's fixed point. The
        call's PRNG key and the version label are taken now, so whatever else calls the extractor meanwhile (search
        & ask on the rollout's ask thread, a merge) cannot change what this call samples."""
        reqs = self._requests(trajs, step, every=False)
        shown, prompts = self.mgr.distill_prompts(reqs)
        key = None
        if prompts:
            key = jax.random.fold_in(jax.random.key(self.seed + 7919), self.calls)
            self.calls += 1
        version = self.sampler_version

        def run() -> list[Generation]:
            return self.generate(prompts, key, version) if prompts else []

        if self.inline:
            fut: cf.Future = cf.Future()
            fut.set_result(run())
        else:
            fut = self._executor.submit(run)
        return PendingDistill(reqs, shown, prompts, fut)

    def distill_apply(self, pending: PendingDistill) -> float:
        """Waits for a launched distillation and applies its ops to the bank; returns the seconds waited."""
        t0 = time.perf_counter()
        responses = pending.future.result()
        waited = time.perf_counter() - t0
        self.mgr.apply_distilled(pending.requests, pending.shown, pending.prompts, responses)
        return waited

    def merge(self, step: int) -> dict:
        return self.mgr.merge(step)

    def dedup(self, threshold: float) -> None:
        """One offline deduplication pass over the bank (``bank.offline_dedup``)."""
        self.mgr.dedup(threshold)

    def entry_text(self, uid) -> str:
        """The text of bank entry ``uid`` ("" when it is gone)."""
        entry = self.mgr.bank.entries.get(uid)
        return entry.text if entry else ""

    def pop_batch(self, step: int):
        """The next full buffer batch for an extractor update in trainer step ``step`` (Eq. 7's t), or None."""
        return self.mgr.pop_extractor_batch(step)

    def mark_trained(self, batch, step: int) -> None:
        """The update on ``batch`` in trainer step ``step`` is dispatched: its samples' c_train / t_last advance
        and the trained weights are ``version`` + 1 (the sampler's from :meth:`sampler_refreshed` on)."""
        self.mgr.mark_trained(batch, step)
        self.version += 1

    def sampler_refreshed(self) -> None:
        """The sampler now holds the latest trained weights: later generations are labelled ``version``."""
        self.sampler_version = self.version

    def stats(self) -> dict[str, float]:
        m = self.mgr
        out = {f"bank/{k}": float(v) for k, v in m.counts.items()}
        out["bank/size"] = float(len(m.bank.entries))
        out["bank/extractor_buffer"] = float(len(m.buffer))
        for name, xs in (("search_ms", self.search_ms), ("search_ask_ms", self.ask_ms)):
            if xs:
                out[f"{name}_p50"] = float(np.percentile(xs, 50))
                out[f"{name}_p99"] = float(np.percentile(xs, 99))
        return out

    # -- persistence (directory per checkpoint step) ----------------------------------------------
    def save(self, path: str) -> None:
        """The manager's store, plus this track's call counter and the query-embedding cache: a resumed run
        must see the same cache hits (an embedding computed in another batch may differ in the last bit)."""
        self.mgr.save(path)
        cache = self.mgr.cache.state_dict()
        vecs = cache["vectors"] if cache["keys"] else np.zeros((0, self.mgr.bank.dim), np.float32)
        np.save(os.path.join(path, "query_cache.npy"), vecs, allow_pickle=False)
        tmp = os.path.join(path, "track.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"calls": self.calls, "version": self.version, "query_cache_keys": cache["keys"]}, f)
        os.replace(tmp, os.path.join(path, "track.json"))

    def load(self, path: str) -> None:
        self.mgr.load(path)
        from comprl_jax.experience.persist import read_json

        meta = read_json(os.path.join(path, "track.json"))
        self.calls = int(meta["calls"])
        self.version = self.sampler_version = int(meta.get("version", 0))  # saved joined: the two agree
        vecs = np.load(os.path.join(path, "query_cache.npy"), allow_pickle=False)
        try:
            self.mgr.cache.load_state_dict({"keys": meta["query_cache_keys"], "vectors": vecs})
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.mgr.close()
