"""The env pool's process backend: one child process per worker, fed JSON over a pipe by a dispatcher thread.

Recovery when a child dies or hangs is described in ``comprl_jax.envs.pool`` (module docstring).
"""

from __future__ import annotations

import collections
import json
import queue
import signal
import threading
import time
from typing import Any

from comprl_jax.envs.pool_calls import (
    SENTINEL,
    Request,
    describe,
    digest,
    drop_env,
    execute,
    failure,
    resolve,
)


def _child_main(conn, env_id: str, entry_point: str, kwargs_json: str) -> None:
    """Worker process: JSON requests in, JSON results out, until 'close' or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which shuts us down cleanly
    # The parent terminates a child whose request hung: leave through the ``finally`` below, so that every env
    # is closed (an SWE env's container or scratch clone would otherwise outlive us). A hang the interpreter
    # cannot interrupt ends with the parent's SIGKILL instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    kwargs = json.loads(kwargs_json)
    envs: dict[int, Any] = {}
    try:
        conn.send_bytes(b'{"ready": true}')
    except OSError:  # BrokenPipeError: the parent stopped before we were up (e.g. on a missing data file)
        return
    try:
        while True:
            try:
                msg = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            if msg["op"] == "close":
                break
            result = execute(
                envs, entry_point, kwargs, msg["op"], msg["slot"], msg.get("arg"), env_id, msg.get("replay")
            )
            try:
                conn.send_bytes(json.dumps(result).encode())
            except (BrokenPipeError, OSError):
                break
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the closing short
        for slot in list(envs):
            drop_env(envs, slot)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


class _Episode:
    """What the parent keeps to rebuild a slot's episode on a fresh worker process."""

    __slots__ = ("seed", "actions", "digest")

    def __init__(self, seed: int, obs: str):
        self.seed, self.actions, self.digest = seed, [], digest(obs)


class _WorkerDied(Exception):
    """The child process is gone or unusable. ``cause`` says how; with ``exit_status`` it is completed by how the
    process ended; ``hung`` when we kill it for running past a request's deadline."""

    def __init__(self, cause: str, hung: bool = False, exit_status: bool = False):
        super().__init__(cause)
        self.cause, self.hung, self.exit_status = cause, hung, exit_status


def _exit_text(code: int | None) -> str:
    """How a process ended, from its ``exitcode``."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ProcessWorker:
    """A dispatcher thread in the parent feeding one child process over a pipe (requests pipelined, see _loop).

    The request bookkeeping (in flight, backlog, each slot's replayable episode) lives on the dispatcher thread."""

    PIPELINE = 4
    # Seconds a terminated child has to close its envs before SIGKILL (removing a container takes ~1 s); only a
    # child stuck where Python cannot interrupt it waits it out.
    TERM_GRACE_S = 10.0

    def __init__(self, name, env_id, entry_point, kwargs, stats, ctx, startup_timeout_s: float):
        self.name, self.entry_point, self.kwargs, self.stats, self.ctx = name, entry_point, kwargs, stats, ctx
        self.env_id = env_id
        self.startup_timeout_s = startup_timeout_s
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # C-level: cheaper per request than Queue
        self.proc = self.conn = None
        self._ready = False
        self._closed = False
        self._life_lock = (
            threading.Lock()
        )  # close() vs a restart in the dispatcher: no child spawned after close
        self._episodes: dict[int, _Episode] = {}  # slot -> its live episode, replayable from its seed
        # slot -> why its env is gone (the worker process it lived in was replaced): its next step replays.
        self._stale: dict[int, str] = {}
        self._routed: set[int] = (
            set()
        )  # slots the current child was sent requests for (it may hold their env)
        self._spawn()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(
            target=_child_main,
            args=(child, self.env_id, self.entry_point, json.dumps(self.kwargs)),
            name=self.name,
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.conn, self._ready = parent, False

    def _kill(self) -> str:
        """Stops the child; returns how it had ended before we stopped it (see ``_exit_text``)."""
        proc, conn = self.proc, self.conn
        try:
            conn.close()
        except OSError:
            pass
        proc.join(0.5)
        ended = _exit_text(proc.exitcode)
        if proc.is_alive():
            proc.terminate()  # the child closes its envs (containers, scratch clones), then exits
            proc.join(self.TERM_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
        return ended

    def _send(self, req: Request) -> None:
        if not self._ready:  # a (re)started child: wait for its imports, which count against no request
            try:
                ready = self.conn.poll(self.startup_timeout_s)
                if ready:
                    self.conn.recv_bytes()
            except (EOFError, OSError):
                raise _WorkerDied("while starting", exit_status=True) from None
            if not ready:
                raise _WorkerDied(f"did not start within {self.startup_timeout_s:g} s")
            self._ready = True
        msg = {"op": req.op, "slot": req.slot, "arg": req.arg}
        if req.replay is not None:
            msg["replay"] = req.replay
        try:
            self.conn.send_bytes(json.dumps(msg).encode())
        except (OSError, ValueError):
            raise _WorkerDied(f"before it was sent {req.op}", exit_status=True) from None
        self._routed.add(req.slot)

    def _prepare(self, req: Request) -> bool:
        """Before a send: the first step on a slot whose env died with a replaced child carries the episode's
        replay. Returns False when the request was failed here instead (the episode cannot be rebuilt)."""
        req.replay, req.timeout = None, req.base_timeout
        why = self._stale.pop(req.slot, None)
        if why is None or req.op != "step":
            return True
        episode = self._episodes.get(req.slot)
        if episode is None:
            self.stats.add("errors")
            message = (
                f"step on slot {req.slot} of {self.env_id}: no live env: {why}, and the episode cannot be rebuilt "
                "(it was reset without a seed, or had already failed); reset it"
            )
            resolve(req, failure(req.op, message))
            return False
        req.replay = {"seed": episode.seed, "actions": list(episode.actions), "digest": episode.digest}
        # The replay is a reset plus one step per earlier reply: the deadline covers them.
        req.timeout = self.startup_timeout_s + req.base_timeout * (len(episode.actions) + 1)
        self.stats.add("replays")
        return True

    def _record(self, req: Request, result: list) -> None:
        """Keeps each slot's replayable episode in step with what the child reported."""
        slot, info = req.slot, result[-1]
        if info.get("failed"):
            self._episodes.pop(slot, None)
        elif req.op == "reset":
            if req.arg is None:  # drawn from the env's own RNG: not reproducible in a fresh process
                self._episodes.pop(slot, None)
            else:
                self._episodes[slot] = _Episode(req.arg, result[0])
        elif slot in self._episodes:
            if result[2] or result[3]:  # ended: nothing left to rebuild
                del self._episodes[slot]
            else:
                episode = self._episodes[slot]
                episode.actions.append(req.arg)
                episode.digest = digest(result[0])

    def _loop(self) -> None:
        # Up to PIPELINE requests are in flight to the child, which answers them in order: the child starts its
        # next request while the parent is still handling the previous result, so it does not sit idle for a
        # round trip per step. The oldest in-flight request (the head) is the one the child is running; its
        # deadline starts when it becomes the head.
        inflight: collections.deque[Request] = collections.deque()
        backlog: collections.deque[Request] = collections.deque()  # to (re)send after a restart, in order
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
                    if req is SENTINEL:
                        closing = True
                        continue
                if req.future.cancelled() or not self._prepare(req):
                    continue
                try:
                    self._send(req)
                except _WorkerDied as e:
                    # With requests in flight, the child died on an earlier one: the read below finds out and
                    # restarts. This one was not sent (so not routed): keep its slot stale for the resend.
                    if inflight:
                        self._stale.setdefault(req.slot, "")
                        backlog.appendleft(req)
                        break
                    self._restart(req, e, backlog)
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
                    raise _WorkerDied(f"timed out after {head.timeout:g} s", hung=True)
                try:
                    result = json.loads(self.conn.recv_bytes())
                except (EOFError, OSError):  # the pipe closed: the cause is how the process ended
                    raise _WorkerDied(f"while running {head.op}", exit_status=True) from None
                except ValueError as e:
                    raise _WorkerDied(f"sent an unreadable reply ({describe(e)})") from None
            except _WorkerDied as e:
                inflight.popleft()
                backlog.extendleft(reversed(inflight))  # the rest go to the fresh child, in their order
                inflight.clear()
                self._restart(head, e, backlog)
                continue
            inflight.popleft()
            if inflight:
                inflight[0].deadline = time.monotonic() + inflight[0].timeout
            if result[-1].get("failed"):
                self.stats.add("errors")
            self._record(head, result)
            resolve(head, result)
        try:
            self.conn.send_bytes(b'{"op": "close"}')
        except (OSError, ValueError):
            pass

    def _restart(self, req: Request, error: _WorkerDied, backlog: collections.deque) -> None:
        """Replaces the child process, which hung on ``req`` or died under or before it.

        Every env died with the old child: all slots are marked stale, so each slot's next step rebuilds its
        episode (``_prepare``). ``req`` goes first to the fresh child when that is safe -- a death is retried once,
        a hang is not -- and otherwise fails with a message that names the slot, the env id and the cause.
        """
        self.stats.add("restarts")
        if error.hung:
            self.stats.add("timeouts")
        with self._life_lock:
            ended = self._kill()
            closed = self._closed
            if not closed:
                self._spawn()
        if error.hung:
            cause = f"{req.op} on slot {req.slot} of {self.env_id} {error.cause}"
        elif error.exit_status:
            cause = f"the worker process {ended} {error.cause}"
        else:
            cause = f"the worker process {error.cause}"
        for slot in (*self._routed, *self._stale, req.slot):  # their envs died with the old child
            self._stale[slot] = f"its worker process was replaced ({cause})"
        self._routed.clear()
        if not error.hung and req.attempts == 0 and not closed:
            req.attempts, req.first_cause = 1, cause
            self.stats.add("retries")
            backlog.appendleft(req)
            return
        self._episodes.pop(req.slot, None)
        where = f"{req.op} on slot {req.slot} of {self.env_id}"
        if error.hung:
            message = f"{cause}; its worker process was killed and restarted (a hung request is not retried)"
        elif closed:
            message = f"{where}: {cause}, while the pool was closing"
        else:
            again = "again" if req.first_cause == cause else f"this time; the first time {req.first_cause}"
            message = (
                f"{where} failed twice, on the worker it was sent to and on a fresh one (retried once): {cause}, "
                f"{again}; the env is rebuilt on the next reset"
            )
        self.stats.add("errors")
        resolve(req, failure(req.op, message))

    def close(self, wait_s: float) -> None:
        self.queue.put(SENTINEL)
        self._thread.join(wait_s)
        with self._life_lock:
            self._closed = True
            self._kill()
