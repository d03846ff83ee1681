"""The extractor's background work within a run and the fixed points where it is joined (SPEC §6).

Two kinds of work run beside the actor's track:

* **CISPO updates** (:meth:`ExtractorUpdates.dispatch`): one per full buffer batch, dispatched asynchronously at the
  end of a step; :meth:`ExtractorUpdates.join` waits for them and puts their metrics in the row of their step. With
  disjoint placement the trainer joins them after the next step's rollout, so they run on the extractor's devices
  while the actor plays. The extractor's sampler keeps the weights from before them until a join with
  ``refresh=True`` (``dispatch_update(refresh=False)``): search & ask during that rollout samples those (its
  generations say which version, and train against their own behaviour logprobs).
* **The producer-consumer distillation** (:meth:`ExtractorUpdates.launch_distill`): a step's distillation
  generates in the background and its ops reach the bank at :meth:`ExtractorUpdates.join_distill`.

Where the joins happen is fixed whatever the placement (after the rollout, at checkpoints, evaluations and the
end), and a refresh first joins the distillation (a refresh changes the weights it samples), so a resumed run
replays the same weights and the same bank (tests/test_placement.py, tests/test_trainer.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from comprl_jax.loop.extractor_track import ExtractorTrack, PendingDistill
from comprl_jax.roles import role as roles
from comprl_jax.roles.train_batches import extractor_batch
from comprl_jax.rollout.episodes import Trajectory


@dataclasses.dataclass
class PendingUpdate:
    """An extractor update in flight: its metrics row, device metrics, host metrics and timing."""

    row: dict
    metrics: Any
    host: dict
    step: int
    t0: float
    watcher: threading.Thread
    done: dict


class ExtractorUpdates:
    """The extractor's updates and distillation in flight, for one run.

    ``track`` / ``extractor``: the run's extractor track and role (None in runs without experience: nothing is ever
    in flight). ``event(name, step, start, end)``: records a wall-clock span in the run's timeline.
    """

    def __init__(
        self,
        track: ExtractorTrack | None,
        extractor: roles.Role | None,
        event: Callable[[str, int, float, float], None],
    ):
        self.track, self.extractor, self._event = track, extractor, event
        self._pending: list[PendingUpdate] = []
        self._distilling: PendingDistill | None = None
        self._distill_wait_s = 0.0
        # A sampler refresh not yet in a metrics row (it may happen at an evaluation's or a checkpoint's join,
        # between rows): the next logged row reports it.
        self.refresh_unreported = False

    @property
    def in_flight(self) -> bool:
        """Updates dispatched and not joined yet."""
        return bool(self._pending)

    def take_distill_wait(self) -> float:
        """Seconds spent waiting for background distillations since the last call (a row's
        ``time/distill_wait_s``)."""
        waited, self._distill_wait_s = self._distill_wait_s, 0.0
        return waited

    def dispatch(self, step: int, row: dict) -> None:
        """One CISPO update per full buffer batch (SPEC §3), dispatched asynchronously; :meth:`join` adds their
        metrics to ``row``. The bank-side bookkeeping (``mark_trained``) needs only the batch and happens now, at its
        fixed point of the step."""
        while (samples := self.track.pop_batch(step)) is not None:
            batch, host = extractor_batch(samples, self.extractor.model.tokenizer, self.track.version)
            self.track.mark_trained(samples, step)
            t0 = time.time()
            # The sampler's refresh waits for the join (the updates' fixed end point).
            device_metrics = roles.dispatch_update(self.extractor, batch, refresh=False)
            done: dict[str, float] = {}
            # Records when the device work finished (a wait, not a dispatch: safe on any thread).
            watcher = threading.Thread(
                target=lambda device_metrics=device_metrics, done=done: (
                    jax.block_until_ready(device_metrics),
                    done.setdefault("end", time.time()),
                ),
                name="extractor-update-watch",
                daemon=True,
            )
            watcher.start()
            self._pending.append(PendingUpdate(row, device_metrics, host, step, t0, watcher, done))

    def launch_distill(self, trajs: Sequence[Trajectory], step: int) -> None:
        """Starts step ``step``'s distillation in the background; its ops reach the bank at the next
        :meth:`join_distill`."""
        self._distilling = self.track.distill_launch(trajs, step)

    def join_distill(self) -> None:
        """Waits for the background distillation (if any) and applies its ops to the bank; the wait goes to the next
        row's ``time/distill_wait_s``."""
        pending, self._distilling = self._distilling, None
        if pending is not None:
            self._distill_wait_s += self.track.distill_apply(pending)

    def join(self, refresh: bool = True) -> bool:
        """Waits for the updates in flight (if any) and puts their metrics (the mean over a row's updates;
        ``updates`` = how many) in the row of their step. ``refresh``: the distillation is joined first, then the
        extractor's sampler takes the updated weights (returns whether it did)."""
        if refresh:
            self.join_distill()
        pending, self._pending = self._pending, []
        by_row: dict[int, list] = {}
        for p in pending:
            out = {**jax.device_get(p.metrics), **p.host}
            p.watcher.join()
            self._event("extractor_update", p.step, p.t0, p.done.get("end", time.time()))
            by_row.setdefault(id(p.row), [p.row, []])[1].append(out)
        for row, outs in by_row.values():
            for k in outs[0]:
                vals = [o[k] for o in outs if k in o]
                agg = max if k.endswith("_max") or k == "step" else None
                row[f"extractor/{k}"] = float(agg(vals)) if agg else float(np.nanmean(vals))
            row["extractor/updates"] = float(len(outs))
        if refresh and self.extractor is not None and self.extractor.apply_refresh():
            self.track.sampler_refreshed()
            self.refresh_unreported = True
            return True
        return False
