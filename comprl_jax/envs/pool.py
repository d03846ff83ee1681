"""The async environment pool: many text-env episodes on worker threads or processes, driven by futures.

``EnvPool(env_id, num_slots, num_workers, backend)`` owns ``num_slots`` episode lanes ("slots"); slot ``s`` lives
on worker ``s % num_workers``, which owns that slot's env instance and runs its requests in order.

* ``submit_reset(slot, seed)`` -> Future of ``(obs, info)``; ``submit_step(slot, reply)`` -> Future of
  ``(obs, reward, terminated, truncated, info)``. ``reset_group(slots, seed)`` resets the K slots of a group with
  one seed, so they start from the identical initial state.
* Backends: ``"thread"`` and ``"process"`` (spawn start method, pipes carry JSON text only, never pickled objects;
  each child gets up to ``pool_process.ProcessWorker.PIPELINE`` requests ahead). Threads only overlap what releases the GIL:
  NLE's ``step`` does not (``launch/bench/envs.py --gil``: beside a spinning thread it keeps ~0.5 of its rate, like
  pure Python), its ``reset`` does in part, and our text rendering is Python, so for MiniHack the thread backend
  is about concurrency and fault isolation, not speed (~0.7x one env in a loop on 2 cores); use ``"process"``
  for parallel speed-up there and for GIL-bound TextWorld / ALFWorld. Results are JSON round-tripped in both, so
  infos hold plain str / int / float / bool / list / dict whatever the backend.
* Faults: an env that raises ends its episode as a failure (``terminated=True``, ``info["error"]`` and
  ``info["failed"]`` set) and is rebuilt on the next reset; a call that runs past ``timeout_s`` ends the same
  way. A hung thread is abandoned (daemon) and a fresh worker thread takes over the worker's other slots; the
  abandoned thread closes the hung env if its call ever returns. A hung process is terminated and respawned; its
  SIGTERM handler closes every env it held (containers, scratch clones) before it exits. Every ``info["error"]``
  names the request, the slot, the env id and the cause (the exception with its message and where it was raised,
  the timeout, or how the worker process ended).
* Worker recovery (process backend): the parent keeps, per slot, the episode's reset seed and the replies stepped
  since, with a digest of the last observation. When a worker process dies or is replaced, the requests it held
  go to the fresh one in their order, and each slot's first step there first rebuilds the env: reset with the
  seed, replay the replies, compare the observation digest (an env that is not deterministic in seed + actions
  fails that check with a clear error instead of playing on from another state). The request that was running
  when the process *died* is retried once on the fresh worker (a reset as is, a step through the replay); one
  that *hung* is not retried (it would most likely hang again) and fails as a timeout. An episode reset without
  a seed cannot be rebuilt: its next step fails and says so. ``stats()`` counts errors, timeouts, restarts,
  retries and replays; the pool keeps going throughout.
* Modules: ``pool_calls`` (one request against an env, shared by both backends), ``pool_process`` (the process
  backend's worker), this one (the pool, the thread backend).
* Shutdown: ``close()`` (also via ``with EnvPool(...)``, ``atexit`` and on KeyboardInterrupt through the context
  manager) stops threads, asks processes to exit, then terminates / kills stragglers: no orphans.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import json
import multiprocessing as mp
import queue
import threading
import time
import weakref
from typing import Any

from comprl_jax.envs import registry
from comprl_jax.envs.pool_calls import (  # noqa: F401 - failure / execute are part of this module's interface
    SENTINEL,
    Request,
    Stats,
    drop_env,
    execute,
    failure,
    resolve,
)
from comprl_jax.envs.pool_process import ProcessWorker


class _ThreadWorker:
    """Runs requests on one thread; a watchdog replaces the thread when a call hangs past its deadline."""

    def __init__(self, name: str, env_id: str, entry_point: str, kwargs: dict, stats: Stats):
        self.name, self.entry_point, self.kwargs, self.stats = name, entry_point, kwargs, stats
        self.env_id = env_id
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # C-level: cheaper per request than Queue
        self.envs: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._closing = threading.Lock()
        self._gen = 0
        self._current: Request | None = None
        self._threads: list[threading.Thread] = []
        self._start_thread()

    def _start_thread(self) -> None:
        t = threading.Thread(
            target=self._loop, args=(self._gen,), name=f"{self.name}-g{self._gen}", daemon=True
        )
        self._threads.append(t)
        t.start()

    def _loop(self, gen: int) -> None:
        while True:
            req = self.queue.get()
            if req is SENTINEL:  # closing: the current thread closes the worker's envs (a stuck one cannot)
                with self._lock:
                    envs = self.envs if gen == self._gen else {}
                with self._closing:
                    for slot in list(envs):
                        drop_env(envs, slot)
                return
            with self._lock:
                if gen != self._gen:  # replaced while waiting: hand the request back and leave
                    self.queue.put(req)
                    return
                req.deadline = time.monotonic() + req.timeout
                self._current, envs = req, self.envs
            result = execute(envs, self.entry_point, self.kwargs, req.op, req.slot, req.arg, self.env_id)
            with self._lock:
                abandoned = gen != self._gen  # the watchdog already failed this request and replaced us
                if not abandoned:
                    self._current = None
            # abandoned: the env we were left with is no longer the pool's; close it (an SWE env's container)
            if abandoned:
                drop_env(envs, req.slot)
                return
            if result[-1].get("failed"):
                self.stats.add("errors")
            resolve(req, result)

    def check(self, now: float) -> None:
        """Called by the watchdog: fails a call past its deadline and replaces the stuck thread."""
        with self._lock:
            req = self._current
            if req is None or now < req.deadline:
                return
            self._current = None
            self._gen += 1
            # The hung env stays with the abandoned thread; the other slots' envs carry over. dict.copy() runs
            # without releasing the GIL: the hung thread may still add or drop an entry of the old dict.
            envs = self.envs.copy()
            envs.pop(req.slot, None)
            self.envs = envs
            self._start_thread()
        self.stats.add("timeouts", "restarts")
        message = (
            f"{req.op} on slot {req.slot} of {self.env_id} timed out after {req.timeout:g} s; its env was left to "
            "the hung thread and is rebuilt on the next reset"
        )
        resolve(req, failure(req.op, message))

    def close(self, wait_s: float) -> None:
        self.queue.put(SENTINEL)
        self._threads[-1].join(wait_s)  # abandoned (hung) threads are daemons: not waited for
        with self._lock:
            busy = self._current.slot if self._current is not None else None
        with self._closing:  # the thread may be closing them too (on the sentinel): one close per env
            for slot in list(self.envs):
                if slot != busy:  # never close an env a stuck thread is still inside
                    drop_env(self.envs, slot)


def _close_pool(ref: weakref.ref) -> None:
    pool = ref()
    if pool is not None:
        pool.close()


class EnvPool:
    """Async pool of text-env episodes (see the module docstring).

    Args:
      env_id: a registered id (``comprl_jax.envs.ENV_IDS``) or a ``"module:Class"`` entry point.
      num_slots: number of concurrent episodes (e.g. rollout batch size).
      num_workers: threads or processes; slot ``s`` runs on worker ``s % num_workers``.
      backend: ``"thread"`` or ``"process"``.
      env_kwargs: constructor overrides; must be JSON-able (they cross a pipe in the process backend).
      timeout_s: per-step limit; ``reset_timeout_s`` (default ``max(timeout_s, 120)``) covers env construction.
      start_method: multiprocessing start method for the process backend (``"spawn"`` or ``"forkserver"``).
    """

    def __init__(
        self,
        env_id: str,
        num_slots: int,
        num_workers: int = 2,
        backend: str = "thread",
        env_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 60.0,
        reset_timeout_s: float | None = None,
        start_method: str = "spawn",
    ):
        if backend not in ("thread", "process"):
            raise ValueError(f"backend must be 'thread' or 'process', got {backend!r}")
        if num_slots <= 0 or num_workers <= 0:
            raise ValueError(f"num_slots and num_workers must be positive, got {num_slots}, {num_workers}")
        if ":" in env_id and env_id not in registry.ENV_IDS:
            entry, base_kwargs = env_id, {}
        else:
            s = registry.spec(env_id)
            entry, base_kwargs = s.entry_point, s.kwargs
        kwargs = {**base_kwargs, **(env_kwargs or {})}
        for k, v in kwargs.items():
            try:
                json.dumps(v)
            except TypeError:
                raise TypeError(
                    f"env_kwargs[{k!r}] is not JSON-able ({type(v).__name__}); pools pass text only"
                ) from None
        self.env_id, self.backend = env_id, backend
        self.num_slots, self.num_workers = int(num_slots), int(num_workers)
        self.timeout_s = float(timeout_s)
        self.reset_timeout_s = float(
            reset_timeout_s if reset_timeout_s is not None else max(timeout_s, 120.0)
        )
        self._stats = Stats()
        self._closed = False
        self._close_lock = threading.Lock()
        if backend == "thread":
            self._workers = [
                _ThreadWorker(f"envpool-{i}", env_id, entry, kwargs, self._stats)
                for i in range(self.num_workers)
            ]
            self._watch_stop = threading.Event()
            self._watchdog = threading.Thread(target=self._watch, name="envpool-watchdog", daemon=True)
            self._watchdog.start()
        else:
            ctx = mp.get_context(start_method)
            self._workers = [
                ProcessWorker(f"envpool-{i}", env_id, entry, kwargs, self._stats, ctx, self.reset_timeout_s)
                for i in range(self.num_workers)
            ]
        atexit.register(_close_pool, weakref.ref(self))

    # -- submission --------------------------------------------------------------------------------
    def _submit(self, op: str, slot: int, arg: Any, timeout: float) -> cf.Future:
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        req = Request(op, slot, arg, timeout)
        self._stats.add(op + "s")
        self._workers[slot % self.num_workers].queue.put(req)
        return req.future

    def submit_reset(self, slot: int, seed: int | None) -> cf.Future:
        """Future of ``(obs, info)`` for a new episode in ``slot`` seeded with ``seed``."""
        return self._submit("reset", slot, None if seed is None else int(seed), self.reset_timeout_s)

    def submit_step(self, slot: int, reply: str) -> cf.Future:
        """Future of ``(obs, reward, terminated, truncated, info)`` for the actor's ``reply`` in ``slot``."""
        return self._submit("step", slot, str(reply), self.timeout_s)

    def reset_group(self, slots, seed: int) -> list[cf.Future]:
        """Resets every slot of a group with the same ``seed`` (identical initial states)."""
        return [self.submit_reset(s, seed) for s in slots]

    def stats(self) -> dict[str, int]:
        with self._stats._lock:
            return dict(self._stats.counts)

    # -- watchdog / shutdown -----------------------------------------------------------------------
    def _watch(self) -> None:
        tick = min(0.05, self.timeout_s / 4)
        while not self._watch_stop.wait(tick):
            now = time.monotonic()
            for w in self._workers:
                w.check(now)

    def close(self, wait_s: float = 5.0) -> None:
        """Stops all workers; pending requests are cancelled. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self.backend == "thread":
            self._watch_stop.set()
        for w in self._workers:
            while True:  # cancel what never started
                try:
                    req = w.queue.get_nowait()
                except queue.Empty:
                    break
                if req is not SENTINEL:
                    req.future.cancel()
            w.close(wait_s)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
