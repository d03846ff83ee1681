"""A run's saved state on disk: Orbax steps (``<workdir>/checkpoints``: the train pytree and the host json) and
the experience store of each step (``<workdir>/experience/<step>/``).

Order (what makes a kill at any moment recoverable): a step's experience store is written first, in its own
atomic directory, then the Orbax step that refers to it; a crash in between leaves no Orbax step, so a resume falls
back to a step whose store exists. Stores of steps Orbax no longer keeps are pruned after each save; a kill during
a store's save leaves ``<step>.tmp-*`` / ``.old-*`` folders, removed at start-up. Restoring takes the newest step
whose checkpoint *and* store are both readable.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

from comprl_jax.runtime import distributed as dist
from comprl_jax.runtime.checkpoint import CheckpointConfig, RunCheckpointer

log = logging.getLogger(__name__)


class RunState:
    """Saves and restores one run's steps (``checkpoint`` section: every, max_to_keep).

    Args:
      workdir: the run directory.
      leader: this process writes the experience store (identical on every process) and prunes.
    """

    def __init__(self, workdir: str, cfg: CheckpointConfig, leader: bool):
        self.workdir, self.leader = workdir, leader
        self.ckpt = RunCheckpointer(os.path.join(workdir, "checkpoints"), cfg.every, cfg.max_to_keep)
        self._remove_stale_stores()

    def experience_dir(self, step: int) -> str:
        return os.path.join(self.workdir, "experience", str(step))

    def due(self, step: int) -> bool:
        return step % self.ckpt.save_every == 0

    def save(self, step: int, train: Any, host: dict, track: Any) -> bool:
        """The experience store of ``track`` (None: no experience) for ``step``, then the Orbax step (``train``:
        the device pytree; ``host``: json). Every process calls it (Orbax saves are collective)."""
        if track is not None and self.leader:  # identical on every process: one writer
            track.save(self.experience_dir(step))
        dist.barrier(f"experience_{step}")
        saved = self.ckpt.save(step, train, {}, host, force=True)
        if self.leader:
            self._prune_experience(step)
        return saved

    def restore(self, abstract: Any, track: Any, accept_host: Callable[[dict], None]):
        """``(step, train, host)`` of the newest readable step, or None. ``track``'s store is loaded from the
        step's directory and ``accept_host(host)`` is called before a step is taken: either raising (a file named)
        falls back to the step before."""

        def accept(step, train, arrays, host):
            if track is not None:  # raises naming the file when the store is unreadable: fall back
                track.load(self.experience_dir(int(host["step"])))
            accept_host(host)

        got = self.ckpt.restore_latest(abstract, accept)
        if got is None:
            return None
        step, train, _, host = got
        log.info("resumed from step %d in %s", step, self.ckpt.directory)
        return step, train, host

    def _remove_stale_stores(self) -> None:
        """``experience/<n>.tmp-*`` / ``.old-*`` folders are left by a kill during a store save: never valid."""
        root = os.path.join(self.workdir, "experience")
        if not self.leader or not os.path.isdir(root):
            return
        for name in os.listdir(root):
            if ".tmp-" in name or ".old-" in name:
                log.info("removing stale experience folder %s", os.path.join(root, name))
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def _prune_experience(self, step: int) -> None:
        root = os.path.join(self.workdir, "experience")
        if not os.path.isdir(root):
            return
        keep = {str(s) for s in self.ckpt.all_steps()}
        for name in os.listdir(root):
            if name.isdigit() and name not in keep and int(name) < step:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
