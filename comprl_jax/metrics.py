"""Run metrics: JSONL (the record of truth), TensorBoard, a progress bar, device memory, and PNG curves.

Only process 0 writes (multi-host runs log once). Values are host scalars: callers pass metrics that were
already fetched (one step late, or every N steps) so that logging never forces a device sync in the loop.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np


def _scalar(v: Any) -> float | None:
    try:
        x = float(np.asarray(v))
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


class MetricsWriter:
    """Appends ``{"step": s, "time": t, **scalars}`` lines to ``<workdir>/metrics.jsonl`` and mirrors them to
    TensorBoard under ``<workdir>/tb``.

    Resumes cleanly: on start, lines with ``step >= resume_step`` are dropped from the JSONL (they were written
    after the checkpoint the run resumes from), so the file reads as one uninterrupted run.
    """

    def __init__(self, workdir: str, resume_step: int = 0, tensorboard: bool = True):
        self.workdir = workdir
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        if os.path.exists(self.path):
            kept = [r for r in read_jsonl(self.path) if r.get("step", 0) < resume_step]
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                for r in kept:
                    f.write(json.dumps(r) + "\n")
            os.replace(tmp, self.path)
        if tensorboard:
            self._tb = _summary_writer(os.path.join(workdir, "tb"), purge_step=resume_step or None)

    def write(self, step: int, metrics: Mapping[str, Any], wall_time: float | None = None) -> dict[str, Any]:
        record: dict[str, Any] = {
            "step": int(step),
            "time": wall_time if wall_time is not None else time.time(),
        }
        for k, v in sorted(metrics.items()):
            s = _scalar(v)
            if s is not None:
                record[k] = s
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if self._tb is not None:
                for k, v in record.items():
                    if k not in ("step", "time"):
                        self._tb.add_scalar(k, v, step)
        return record

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _summary_writer(logdir: str, purge_step: int | None):
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX imports torch when it is installed (here: only as a test-time reference), which would load torch's
    own OpenMP runtime and thread pools into the training process next to XLA's. Hide it for that one import.
    """
    import sys

    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hidden:
            del sys.modules["torch"]
    return SummaryWriter(logdir, purge_step=purge_step)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Records of a metrics file; a torn last line (crash mid-write) is ignored."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def percentiles(values: Iterable[float], qs=(50, 90, 99)) -> dict[str, float]:
    """``{"p50": .., "p90": .., "p99": ..}`` of a sample (empty -> {})."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return {}
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


_TRACKING = False


def start_memory_tracking() -> bool:
    """Starts jax-smi's background memory sampler once per process (device memory profile in /dev/shm; inspect
    with the ``jax-smi`` command): its thread rewrites one fixed file, so a second sampler would race it.
    Returns False where it does not run (CPU backend, no /dev/shm)."""
    global _TRACKING
    if _TRACKING:
        return True
    # Not on CPU: there is no device memory to profile, and the sampler thread sits inside XLA's C++ profiler
    # most of the time, so a process exiting under it can abort ("FATAL: exception not rethrown").
    if jax.default_backend() == "cpu":
        return False
    try:
        from jax_smi import initialise_tracking

        initialise_tracking()
        _TRACKING = True
        return True
    except Exception:  # noqa: BLE001 -- memory tracking is best-effort observability
        return False


def device_memory_mb() -> float | None:
    """Bytes in use on device 0 (MB) where the backend reports it (GPU/TPU), else None (CPU)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    if not stats:
        return None
    return stats.get("bytes_in_use", 0) / 2**20


def plot_curves(
    runs: Mapping[str, str],
    out_png: str,
    keys: tuple[str, ...] = ("success", "actions_per_episode"),
    smooth: int = 5,
) -> str:
    """One panel per metric key, one line per run (like the paper's Fig. 6-7: baseline vs Complementary RL).

    Args:
      runs: label -> metrics.jsonl path.
      out_png: output path.
      smooth: moving-average window over steps.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=False):
        for label, path in runs.items():
            rows = [r for r in read_jsonl(path) if key in r]
            if not rows:
                continue
            steps = np.array([r["step"] for r in rows])
            vals = np.array([r[key] for r in rows], dtype=np.float64)
            if smooth > 1 and len(vals) >= smooth:
                kernel = np.ones(smooth) / smooth
                vals = np.convolve(vals, kernel, mode="valid")
                steps = steps[smooth - 1 :]
            ax.plot(steps, vals, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
