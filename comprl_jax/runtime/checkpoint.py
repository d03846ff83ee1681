"""Run checkpoints through one Orbax ``CheckpointManager``: every piece of run state, atomic, auto-resume.

A checkpoint step holds three items, written together (Orbax writes into a temporary directory and renames it
when all items are finalised, so a crash mid-save leaves the previous step intact):

* ``train``: the device pytree (actor + extractor params and AdamW states, RNG keys): ``StandardSave`` /
  ``StandardRestore`` into an abstract target carrying the shardings, so a restore lands sharded.
* ``arrays``: host numpy arrays of run state (the experience bank's key embeddings, ...): ``StandardSave``.
* ``host``: JSON run state (bank entries and usage stats, op log, extractor buffer, task-sampler state, counters,
  numpy RNG state, the config): ``JsonSave``.

``restore_latest`` walks steps newest-first and falls back to the previous one when a step is unreadable,
logging which step was skipped and why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from comprl_jax.runtime.fields import check


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Config section ``checkpoint``: save every ``every`` steps, keep the newest ``max_to_keep`` (>= 2, so a
    corrupted latest step has a fallback)."""

    every: int = 5
    max_to_keep: int = 3

    def __post_init__(self):
        check(self.every >= 1, "every", "must be >= 1", self.every)
        check(
            self.max_to_keep >= 2,
            "max_to_keep",
            "must be >= 2 (a fallback for a corrupted latest step)",
            self.max_to_keep,
        )


log = logging.getLogger(__name__)

ITEMS = ("train", "arrays", "host")
_EMPTY_KEY = "__empty_arrays__"


class RunCheckpointer:
    """Saves and restores ``(train pytree, host arrays, host json)`` per step.

    Args:
      directory: ``<workdir>/checkpoints``; created if missing.
      save_every: save when ``step % save_every == 0`` (``force=True`` saves regardless, e.g. at exit).
      max_to_keep: newest steps kept on disk (>= 2 so a corrupted latest step has a fallback).
    """

    def __init__(self, directory: str | os.PathLike, save_every: int = 10, max_to_keep: int = 3):
        if save_every <= 0:
            raise ValueError(f"checkpoint.save_every must be positive, got {save_every}")
        if max_to_keep < 2:
            raise ValueError(
                f"checkpoint.max_to_keep must be >= 2 (fallback on corruption), got {max_to_keep}"
            )
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_every = int(save_every)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            # Synchronous saves: the loop's host state (bank, buffers) is mutated right after; an async save
            # would need a deep copy of it anyway, and CPU runs gain little.
            enable_async_checkpointing=False,
            cleanup_tmp_directories=True,
        )
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    # ------------------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        self._mgr.reload()
        return sorted(self._mgr.all_steps())

    def save(
        self,
        step: int,
        train: Any,
        arrays: Mapping[str, np.ndarray],
        host: Mapping[str, Any],
        *,
        force: bool = False,
    ) -> bool:
        """Saves ``step`` if due (or ``force``). Returns whether a checkpoint was written."""
        if not force and step % self.save_every:
            return False
        if step in self._mgr.all_steps():
            return False
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        # Orbax refuses zero-size arrays (an empty bank): record their shape/dtype in the JSON item instead.
        empty = {k: [list(v.shape), v.dtype.str] for k, v in arrays.items() if v.size == 0}
        arrays = {k: v for k, v in arrays.items() if v.size}
        host = {**host, _EMPTY_KEY: empty}
        saved = self._mgr.save(
            step,
            args=ocp.args.Composite(
                train=ocp.args.StandardSave(train),
                arrays=ocp.args.StandardSave(_box_arrays(arrays)),
                host=ocp.args.JsonSave(dict(host)),
            ),
            force=True,
        )
        self._mgr.wait_until_finished()
        return bool(saved)

    def restore(self, step: int, abstract_train: Any) -> tuple[Any, dict[str, np.ndarray], dict[str, Any]]:
        """Restores one step. ``abstract_train``: a pytree of ``jax.ShapeDtypeStruct`` with shardings (e.g. from
        ``jax.eval_shape`` of the init plus the shardings), so arrays come back sharded as in the live run."""
        restored = self._mgr.restore(
            step,
            args=ocp.args.Composite(
                train=ocp.args.StandardRestore(abstract_train),
                arrays=ocp.args.StandardRestore(),
                host=ocp.args.JsonRestore(),
            ),
        )
        arrays = _unbox_arrays(restored["arrays"])
        host = dict(restored["host"])
        for k, (shape, dtype) in host.pop(_EMPTY_KEY, {}).items():
            arrays[k] = np.zeros(shape, np.dtype(dtype))
        return restored["train"], arrays, host

    def restore_latest(self, abstract_train: Any, accept: Any = None):
        """Newest readable step: ``(step, train, arrays, host)``, or None when the directory holds no step.

        A step that fails to restore (truncated file, bad JSON, missing item) is skipped with a warning naming
        the step and the error, and the previous step is tried. ``accept(step, train, arrays, host)`` loads the
        rest of the run state that belongs to the step (the experience store); when it raises, the step is
        skipped the same way, so a run never stays stuck on a step whose side state is unreadable.
        """
        for step in reversed(self.all_steps()):
            try:
                train, arrays, host = self.restore(step, abstract_train)
                if accept is not None:
                    accept(step, train, arrays, host)
            except Exception as err:  # noqa: BLE001 -- any unreadable step means: fall back
                log.warning(
                    "checkpoint step %d in %s is unreadable (%s: %s); falling back to the previous step",
                    step,
                    self.directory,
                    type(err).__name__,
                    str(err).splitlines()[0][:300] if str(err) else "",
                )
                continue
            return step, train, arrays, host
        return None

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()


# Orbax's StandardSave rejects an empty tree and wants string keys without odd characters; keep a fixed
# wrapper so an empty bank still round-trips.
def _box_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    return {"present": np.asarray(1, np.int32), "items": dict(arrays)}


def _unbox_arrays(tree: Any) -> dict[str, np.ndarray]:
    items = tree.get("items", {}) if isinstance(tree, Mapping) else {}
    return {k: np.asarray(jax.device_get(v)) for k, v in (items or {}).items()}
