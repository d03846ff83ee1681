"""One env-pool request against an env (shared by the thread and process backends), and its plumbing.

``execute`` runs a reset / step on a worker's env for a slot and never raises for env faults: a failure is a
result (``failure``) whose ``info["error"]`` names the op, the slot, the env id and the cause (``describe``). For
the process backend it can first rebuild a slot's lost episode from its reset seed and replies (``replay``), and
checks the rebuilt observation against the lost one's ``digest``. Results are JSON-able (``jsonable``).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import threading
import traceback
from typing import Any

from comprl_jax.envs import registry

SENTINEL = None  # tells a worker to stop


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


def jsonable(x: Any) -> Any:
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


def digest(obs: str) -> str:
    """Short fingerprint of an observation: what a replayed episode must reproduce (see :func:`execute`)."""
    return hashlib.sha256(obs.encode("utf-8", "surrogatepass")).hexdigest()[:20]


def describe(error: BaseException) -> str:
    """``"RuntimeError: boom (at env.py:12 in _step)"``: type, message (or "no message") and the innermost frame."""
    text = f"{type(error).__name__}: {error}" if str(error) else f"{type(error).__name__} (no message)"
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return text


def _rebuild(envs: dict, entry_point: str, kwargs: dict, slot: int, replay: dict):
    """A fresh env in ``slot`` brought to where the lost one was: reset(seed), then the replies replayed. Returns
    the env, or None when the last observation's digest differs from ``replay["digest"]``."""
    env = envs[slot] = registry.make_from_entry_point(entry_point, **kwargs)
    obs, _ = env.reset(seed=replay["seed"])
    for reply in replay["actions"]:
        obs, *_ = env.step(reply)
    if digest(str(obs)) != replay["digest"]:
        drop_env(envs, slot)
        return None
    return env


def execute(
    envs: dict,
    entry_point: str,
    kwargs: dict,
    op: str,
    slot: int,
    arg: Any,
    env_id: str = "",
    replay: dict | None = None,
) -> list:
    """Runs one request against ``envs[slot]`` (building it when needed); never raises for env faults.

    Shared by both backends. A raising env is dropped from ``envs`` so the slot's next reset rebuilds it.
    ``replay`` (``{"seed", "actions", "digest"}``, process backend after a worker restart): for a step on a slot
    without a live env, rebuild the episode first (:func:`_rebuild`). Every failure names the op, the slot, the
    env id and the cause.
    """
    where = f"slot {slot} of {env_id or entry_point}"
    try:
        if op == "reset":
            for attempt in (0, 1):  # a reset that raises gets one retry on a freshly built env
                env = envs.get(slot)
                try:
                    if env is None:
                        env = envs[slot] = registry.make_from_entry_point(entry_point, **kwargs)
                    obs, info = env.reset(seed=arg)
                    return [str(obs), jsonable(info)]
                except Exception as e:  # noqa: BLE001 - env faults are data here
                    drop_env(envs, slot)
                    if attempt:
                        return failure(
                            op, f"reset of {where} raised twice (a fresh env each time): {describe(e)}"
                        )
        if op == "step":
            env = envs.get(slot)
            if env is None and replay is not None:
                what = f"(reset seed {replay['seed']}, {len(replay['actions'])} replies)"
                try:
                    env = _rebuild(envs, entry_point, kwargs, slot, replay)
                except Exception as e:  # noqa: BLE001
                    drop_env(envs, slot)
                    return failure(
                        op,
                        f"step on {where}: rebuilding the episode on the restarted worker {what} raised "
                        f"{describe(e)}; reset it",
                    )
                if env is None:
                    return failure(
                        op,
                        f"step on {where}: replaying the episode on the restarted worker {what} gave another "
                        "observation than the lost env had (the env is not deterministic in seed + actions); reset it",
                    )
            if env is None:
                return failure(
                    op,
                    f"step on {where}: no live env (not reset on this worker, or its env raised); reset it",
                )
            try:
                obs, reward, term, trunc, info = env.step(arg)
                # Only the info dict can hold non-JSON values (numpy scalars...); the rest is cast directly.
                return [str(obs), float(reward), bool(term), bool(trunc), jsonable(info)]
            except Exception as e:  # noqa: BLE001
                drop_env(envs, slot)
                return failure(op, f"step on {where} raised {describe(e)}")
        return failure(op, f"unknown op {op!r} for {where}")
    except Exception as e:  # noqa: BLE001 - e.g. an info that json cannot encode
        drop_env(envs, slot)
        return failure(op, f"{op} on {where} failed: {describe(e)}")


def drop_env(envs: dict, slot: int) -> None:
    """Closes and removes ``envs[slot]`` (if any); a failing close is ignored. Removed only after the close: a
    close cut short (the worker's SIGTERM) leaves the env in ``envs`` for the worker's final closing."""
    env = envs.get(slot)
    if env is not None:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - the env is already broken; closing is best effort
            pass
        envs.pop(slot, None)


class Request:
    """One reset / step of a slot on its way through a worker; ``future`` gets the result tuple."""

    __slots__ = (
        "op", "slot", "arg", "timeout", "base_timeout", "future", "deadline", "attempts", "first_cause", "replay"
    )  # fmt: skip

    def __init__(self, op: str, slot: int, arg: Any, timeout: float):
        self.op, self.slot, self.arg, self.timeout = op, slot, arg, timeout
        self.base_timeout = timeout  # ``timeout`` is longer while the request carries a replay
        self.future: cf.Future = cf.Future()
        self.deadline = float("inf")  # set when a worker starts the call: queueing time does not count
        self.attempts = 0  # process backend: sends that ended with the worker process dying
        self.first_cause = ""  # ... and how it died the first time
        self.replay: dict | None = (
            None  # process backend: the episode to rebuild first (see pool_process.ProcessWorker)
        )


def resolve(req: Request, result: list) -> None:
    """Sets ``req``'s result unless it is already done (cancelled at close, or failed by a watchdog)."""
    if req.future.done():
        return
    try:
        req.future.set_result(tuple(result))
    except cf.InvalidStateError:  # cancelled at close, or resolved by the watchdog first
        pass


class Stats:
    """Thread-safe counters behind ``EnvPool.stats()``."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(
            ("resets", "steps", "errors", "timeouts", "restarts", "retries", "replays"), 0
        )

    def add(self, *keys: str) -> None:
        with self._lock:
            for k in keys:
                self.counts[k] += 1
