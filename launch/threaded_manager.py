"""An :class:`~comprl_jax.experience.manager.ExperienceManager` with the threads of a serving setting.

* Search: callers block on :meth:`ThreadedExperienceManager.search`; a batcher thread groups queries of concurrent
  callers into micro-batches (flush at ``query_batch`` queries or ``t_max_s`` after the first), and ``search_workers`` threads
  run them through the same pipeline as the synchronous manager.
* Distillation: :meth:`~ThreadedExperienceManager.submit_distill` enqueues finished episodes; a consumer thread
  batches them (``distill_batch``) into extractor calls; :meth:`~ThreadedExperienceManager.drain` waits for them.

The trainer does not use it: it drives the plain manager at fixed points of the step, so a resumed run is
bit-identical. Here the order in which concurrent callers' queries and episodes are served is up to the threads
(the retrieval benchmark and the concurrency tests use it, so it lives in ``launch/``, outside the package).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Sequence

from comprl_jax.experience.manager import DistillRequest, ExperienceManager, Retrieval


class ThreadedExperienceManager(ExperienceManager):
    """Same constructor as :class:`ExperienceManager`; the threads start at once (``close`` or ``with`` stops
    them, answering pending searches first)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._threads: list[threading.Thread] = []
        self._search_q: queue.Queue = queue.Queue()
        self._distill_q: queue.Queue = queue.Queue()
        self._distill_pending = 0
        self._distill_cv = threading.Condition()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.cfg.search_workers, thread_name_prefix="exp-search"
        )
        for target, name in ((self._batch_loop, "exp-batcher"), (self._distill_loop, "exp-distill")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        """Stops the threads (pending searches are answered first)."""
        if not self._threads:
            return
        self._search_q.put(None)
        self._distill_q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []
        self._pool.shutdown(wait=True)
        super().close()

    # -- search ------------------------------------------------------------------------------------
    def search(self, queries: Sequence[str], task_ids: Sequence[str], record: bool = True) -> list[Retrieval]:
        """Retrieves for each (query, task_id); blocks until answered. Thread-safe. Read-only searches
        (``record=False``) and searches after :meth:`close` run in the calling thread."""
        if len(queries) != len(task_ids):
            raise ValueError(f"{len(queries)} queries but {len(task_ids)} task ids")
        if not self._threads or not record:
            return self.search_sync(queries, task_ids, record)
        futs = []
        b = self.cfg.query_batch
        for i in range(0, len(queries), b):
            # One caller's queries travel as one group (<= batch) so the 1 ms flush never splits them.
            group = [
                (q, t, concurrent.futures.Future())
                for q, t in zip(queries[i : i + b], task_ids[i : i + b], strict=True)
            ]
            self._search_q.put(group)
            futs += [f for _, _, f in group]
        return [f.result() for f in futs]

    def _batch_loop(self) -> None:
        """Groups queued query groups into micro-batches: flush at ``batch`` queries or ``t_max_s`` after the first."""
        carry = None
        while True:
            group = carry if carry is not None else self._search_q.get()
            carry = None
            if group is None:
                return
            batch = list(group)
            deadline = time.monotonic() + self.cfg.t_max_s
            stop = False
            while len(batch) < self.cfg.query_batch:
                left = deadline - time.monotonic()
                try:
                    nxt = self._search_q.get(timeout=left) if left > 0 else self._search_q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                if len(batch) + len(nxt) > self.cfg.query_batch:
                    carry = nxt  # starts the next micro-batch
                    break
                batch += nxt
            self._pool.submit(self._answer, batch)
            if stop:
                return

    def _answer(self, batch) -> None:
        try:
            res = self._run_batch([b[0] for b in batch], [b[1] for b in batch])
            for (_, _, f), r in zip(batch, res, strict=True):
                f.set_result(r)
        except Exception as e:  # noqa: BLE001 -- hand the error to every waiting caller
            for _, _, f in batch:
                f.set_exception(e)

    # -- distillation queue ----------------------------------------------------------------------------
    def submit_distill(self, request: DistillRequest) -> None:
        """Producer side of the distillation queue (non-blocking; after :meth:`close`, inline)."""
        with self._distill_cv:
            self._distill_pending += 1
        if self._threads:
            self._distill_q.put(request)
        else:
            self._consume([request])

    def drain(self, timeout: float | None = None) -> None:
        """Blocks until every submitted distillation request has been processed."""
        with self._distill_cv:
            if not self._distill_cv.wait_for(lambda: self._distill_pending == 0, timeout):
                raise TimeoutError(f"{self._distill_pending} distillation requests still pending")

    def _distill_loop(self) -> None:
        while True:
            item = self._distill_q.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.cfg.distill_batch:
                try:
                    nxt = self._distill_q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._consume(batch)
                    return
                batch.append(nxt)
            self._consume(batch)

    def _consume(self, batch: list[DistillRequest]) -> None:
        try:
            self.distill(batch)
        except Exception as e:  # noqa: BLE001 -- a bad extractor call must not kill the consumer
            self.errors.append(f"distill: {type(e).__name__}: {e}")
            self.counts["distill_errors"] += 1
        finally:
            with self._distill_cv:
                self._distill_pending -= len(batch)
                self._distill_cv.notify_all()
