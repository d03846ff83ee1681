"""The async environment pool: many text-env episodes on worker threads or processes, driven by futures.

``EnvPool(env_id, num_slots, num_workers, backend)`` owns ``num_slots`` episode lanes ("slots"); slot ``s`` lives
on worker ``s % num_workers``, which owns that slot's env instance and runs its requests in order.

* ``submit_reset(slot, seed)`` -> Future of ``(obs, info)``; ``submit_step(slot, reply)`` -> Future of
  ``(obs, reward, terminated, truncated, info)``. ``reset_group(slots, seed)`` resets the K slots of a group with
  one seed, so they start from the identical initial state.
* Backends: ``"thread"`` and ``"process"`` (spawn start method, pipes carry JSON text only, never pickled objects;
  each child gets up to ``_ProcessWorker.PIPELINE`` requests ahead). Threads only overlap what releases the GIL:
  NLE's ``step`` does not (``launch/bench/envs.py --gil``: beside a spinning thread it keeps ~0.5 of its rate, like
  pure Python), its ``reset`` does in part, and our text rendering is Python, so for MiniHack the thread backend
  is about concurrency and fault isolation, not speed (~0.7x one env in a loop on 2 cores); use ``"process"``
  for parallel speed-up there and for GIL-bound TextWorld / ALFWorld. Results are JSON round-tripped in both, so
  infos hold plain str / int / float / bool / list / dict whatever the backend.
* Faults: an env that raises ends its episode as a failure (``terminated=True``, ``info["error"]`` and
  ``info["failed"]`` set) and is rebuilt on the next reset; a call that runs past ``timeout_s`` ends the same
  way. A hung thread is abandoned (daemon) and a fresh worker thread takes over the worker's other slots; a hung
  process is terminated and respawned, and the other slots it held report their episode lost on the next step.
  The pool keeps going throughout; ``stats()`` counts errors, timeouts and restarts.
* Shutdown: ``close()`` (also via ``with EnvPool(...)``, ``atexit`` and on KeyboardInterrupt through the context
  manager) stops threads, asks processes to exit, then terminates / kills stragglers: no orphans.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import json
import multiprocessing as mp
import queue
import threading
import time
import weakref
from typing import Any

from comprl_jax.envs import registry

_SENTINEL = None


def _default(x: Any) -> Any:
    if hasattr(x, "tolist"):  # numpy scalars and arrays
        return x.tolist()
    if isinstance(x, (set, frozenset)):
        return sorted(x, key=str)
    return str(x)


_SCALARS = (str, int, float, bool, type(None))


def _plain_copy(x: Any) -> Any:
    """A copy of ``x`` when it is already what a JSON round trip returns (str-keyed dicts, lists, exact str /
    int / float / bool / None), else raises TypeError. The fast path of ``_jsonable``: infos are small and
    almost always plain, and this runs once per step."""
    t = type(x)
    if t in _SCALARS:
        return x
    if t is dict:
        out = {}
        for k, v in x.items():
            if type(k) is not str:
                raise TypeError
            out[k] = _plain_copy(v)
        return out
    if t is list:
        return [_plain_copy(v) for v in x]
    raise TypeError


def _jsonable(x: Any) -> Any:
    try:
        return _plain_copy(x)
    except (TypeError, RecursionError):
        return json.loads(json.dumps(x, default=_default))


def failure(op: str, error: str) -> list:
    """The result of a failed call: the episode ends as a failure with ``error`` recorded in info."""
    info = {"success": False, "failed": True, "error": error, "invalid_action": False}
    if op == "reset":
        return ["", {**info, "task_id": "", "goal": "", "query": ""}]
    return ["", 0.0, True, False, info]


def execute(envs: dict, entry_point: str, kwargs: dict, op: str, slot: int, arg: Any) -> list:
    """Runs one request against ``envs[slot]`` (building it when needed); never raises for env faults.

    Shared by both backends. A raising env is dropped from ``envs`` so the slot's next reset rebuilds it.
    """
    try:
        if op == "reset":
            for attempt in (0, 1):  # a reset that raises gets one retry on a freshly built env
                env = envs.get(slot)
                try:
                    if env is None:
                        env = envs[slot] = registry.make_from_entry_point(entry_point, **kwargs)
                    obs, info = env.reset(seed=arg)
                    return [str(obs), _jsonable(info)]
                except Exception as e:  # noqa: BLE001 - env faults are data here
                    _drop(envs, slot)
                    if attempt:
                        return failure(op, f"reset failed twice: {type(e).__name__}: {e}")
        if op == "step":
            env = envs.get(slot)
            if env is None:
                return failure(
                    op, f"no live env in slot {slot} (its worker restarted after a fault); reset it"
                )
            try:
                obs, reward, term, trunc, info = env.step(arg)
                # Only the info dict can hold non-JSON values (numpy scalars...); the rest is cast directly.
                return [str(obs), float(reward), bool(term), bool(trunc), _jsonable(info)]
            except Exception as e:  # noqa: BLE001
                _drop(envs, slot)
                return failure(op, f"step raised {type(e).__name__}: {e}")
        return failure(op, f"unknown op {op!r}")
    except Exception as e:  # noqa: BLE001 - e.g. an info that json cannot encode
        _drop(envs, slot)
        return failure(op, f"{op} failed: {type(e).__name__}: {e}")


def _drop(envs: dict, slot: int) -> None:
    env = envs.pop(slot, None)
    if env is not None:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - the env is already broken; closing is best effort
            pass


class _Request:
    __slots__ = ("op", "slot", "arg", "timeout", "future", "deadline")

    def __init__(self, op: str, slot: int, arg: Any, timeout: float):
        self.op, self.slot, self.arg, self.timeout = op, slot, arg, timeout
        self.future: cf.Future = cf.Future()
        self.deadline = float("inf")  # set when a worker starts the call: queueing time does not count


def _resolve(req: _Request, result: list) -> None:
    if req.future.done():
        return
    try:
        req.future.set_result(tuple(result))
    except cf.InvalidStateError:  # cancelled at close, or resolved by the watchdog first
        pass


class _ThreadWorker:
    """Runs requests on one thread; a watchdog replaces the thread when a call hangs past its deadline."""

    def __init__(self, name: str, entry_point: str, kwargs: dict, stats: _Stats):
        self.name, self.entry_point, self.kwargs, self.stats = name, entry_point, kwargs, stats
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # C-level: cheaper per request than Queue
        self.envs: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._gen = 0
        self._current: _Request | None = None
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
            if req is _SENTINEL:
                return
            with self._lock:
                if gen != self._gen:  # replaced while waiting: hand the request back and leave
                    self.queue.put(req)
                    return
                req.deadline = time.monotonic() + req.timeout
                self._current, envs = req, self.envs
            result = execute(envs, self.entry_point, self.kwargs, req.op, req.slot, req.arg)
            with self._lock:
                if gen != self._gen:  # the watchdog already failed this request and replaced us
                    return
                self._current = None
            if result[-1].get("failed"):
                self.stats.add("errors")
            _resolve(req, result)

    def check(self, now: float) -> None:
        """Called by the watchdog: fails a call past its deadline and replaces the stuck thread."""
        with self._lock:
            req = self._current
            if req is None or now < req.deadline:
                return
            self._current = None
            self._gen += 1
            # The hung env stays with the abandoned thread; the other slots' envs carry over.
            self.envs = {k: v for k, v in self.envs.items() if k != req.slot}
            self._start_thread()
        self.stats.add("timeouts", "restarts")
        _resolve(req, failure(req.op, f"{req.op} timed out; env in slot {req.slot} abandoned and rebuilt"))

    def close(self, wait_s: float) -> None:
        self.queue.put(_SENTINEL)
        self._threads[-1].join(wait_s)  # abandoned (hung) threads are daemons: not waited for
        with self._lock:
            busy = self._current is not None
        if not busy:  # never close an env a stuck thread may still be inside
            for slot in list(self.envs):
                _drop(self.envs, slot)


def _child_main(conn, entry_point: str, kwargs_json: str) -> None:
    """Worker process: JSON requests in, JSON results out, until 'close' or the parent goes away."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which shuts us down cleanly
    kwargs = json.loads(kwargs_json)
    envs: dict[int, Any] = {}
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            msg = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if msg["op"] == "close":
            break
        result = execute(envs, entry_point, kwargs, msg["op"], msg["slot"], msg.get("arg"))
        try:
            conn.send_bytes(json.dumps(result).encode())
        except (BrokenPipeError, OSError):
            break
    for slot in list(envs):
        _drop(envs, slot)


class _ProcessWorker:
    """A dispatcher thread in the parent feeding one child process over a pipe (requests pipelined, see _loop)."""

    PIPELINE = 4

    def __init__(self, name, entry_point, kwargs, stats, ctx, startup_timeout_s: float):
        self.name, self.entry_point, self.kwargs, self.stats, self.ctx = name, entry_point, kwargs, stats, ctx
        self.startup_timeout_s = startup_timeout_s
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # C-level: cheaper per request than Queue
        self.proc = self.conn = None
        self._ready = False
        self._closed = False
        self._life_lock = (
            threading.Lock()
        )  # close() vs a restart in the dispatcher: no child spawned after close
        self._spawn()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(
            target=_child_main,
            args=(child, self.entry_point, json.dumps(self.kwargs)),
            name=self.name,
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.conn, self._ready = parent, False

    def _kill(self) -> None:
        proc, conn = self.proc, self.conn
        try:
            conn.close()
        except OSError:
            pass
        proc.join(0.5)
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)

    def _send(self, req: _Request) -> None:
        if not self._ready:  # a (re)started child: wait for its imports, which count against no request
            if not self.conn.poll(self.startup_timeout_s):
                raise TimeoutError(f"worker process did not start within {self.startup_timeout_s} s")
            self.conn.recv_bytes()
            self._ready = True
        self.conn.send_bytes(json.dumps({"op": req.op, "slot": req.slot, "arg": req.arg}).encode())

    def _loop(self) -> None:
        # Up to PIPELINE requests are in flight to the child, which answers them in order: the child starts its
        # next request while the parent is still handling the previous result, so it does not sit idle for a
        # round trip per step. The oldest in-flight request (the head) is the one the child is running; its
        # deadline starts when it becomes the head.
        inflight: collections.deque[_Request] = collections.deque()
        backlog: collections.deque[_Request] = collections.deque()  # to (re)send after a restart, in order
        closing = False
        while True:
            while len(inflight) < self.PIPELINE:
                if backlog:
                    req = backlog.popleft()
                elif closing:
                    break
                else:
                    try:
                        req = self.queue.get(block=not inflight)
                    except queue.Empty:
                        break
                    if req is _SENTINEL:
                        closing = True
                        continue
                if req.future.cancelled():
                    continue
                try:
                    self._send(req)
                except (TimeoutError, EOFError, OSError, ValueError) as e:
                    if (
                        inflight
                    ):  # the child died on an earlier request: the read below finds out and restarts
                        backlog.appendleft(req)
                        break
                    self._restart(req, e)
                    continue
                if not inflight:
                    req.deadline = time.monotonic() + req.timeout
                inflight.append(req)
            if not inflight:
                if closing and not backlog:
                    break
                continue
            head = inflight[0]
            try:
                if not self.conn.poll(max(0.0, head.deadline - time.monotonic())):
                    raise TimeoutError(f"{head.op} timed out")
                result = json.loads(self.conn.recv_bytes())
            except (TimeoutError, EOFError, OSError, ValueError) as e:
                inflight.popleft()
                backlog.extendleft(reversed(inflight))  # the rest go to the fresh child, in their order
                inflight.clear()
                self._restart(head, e)
                continue
            inflight.popleft()
            if inflight:
                inflight[0].deadline = time.monotonic() + inflight[0].timeout
            if result[-1].get("failed"):
                self.stats.add("errors")
            _resolve(head, result)
        try:
            self.conn.send_bytes(b'{"op": "close"}')
        except (OSError, ValueError):
            pass

    def _restart(self, req: _Request, error: Exception) -> None:
        """Fails ``req`` (the call that hung or broke the child) and replaces the child process."""
        kind = "timeouts" if isinstance(error, TimeoutError) else "errors"
        self.stats.add(kind, "restarts")
        with self._life_lock:
            self._kill()
            if not self._closed:
                self._spawn()
        _resolve(
            req,
            failure(req.op, f"{type(error).__name__}: {error}; worker process restarted (slot {req.slot})"),
        )

    def close(self, wait_s: float) -> None:
        self.queue.put(_SENTINEL)
        self._thread.join(wait_s)
        with self._life_lock:
            self._closed = True
            self._kill()


class _Stats:
    def __init__(self):
        self._lock = threading.Lock()
        self.counts = {"resets": 0, "steps": 0, "errors": 0, "timeouts": 0, "restarts": 0}

    def add(self, *keys: str) -> None:
        with self._lock:
            for k in keys:
                self.counts[k] += 1


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
        self._stats = _Stats()
        self._closed = False
        self._close_lock = threading.Lock()
        if backend == "thread":
            self._workers = [
                _ThreadWorker(f"envpool-{i}", entry, kwargs, self._stats) for i in range(self.num_workers)
            ]
            self._watch_stop = threading.Event()
            self._watchdog = threading.Thread(target=self._watch, name="envpool-watchdog", daemon=True)
            self._watchdog.start()
        else:
            ctx = mp.get_context(start_method)
            self._workers = [
                _ProcessWorker(f"envpool-{i}", entry, kwargs, self._stats, ctx, self.reset_timeout_s)
                for i in range(self.num_workers)
            ]
        atexit.register(_close_pool, weakref.ref(self))

    # -- submission --------------------------------------------------------------------------------
    def _submit(self, op: str, slot: int, arg: Any, timeout: float) -> cf.Future:
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        req = _Request(op, slot, arg, timeout)
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
                if req is not _SENTINEL:
                    req.future.cancel()
            w.close(wait_s)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
