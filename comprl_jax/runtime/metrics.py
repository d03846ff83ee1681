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


# Panels of curves.png: (title, [(metric key, line style)], y label). The first two are the paper's comparison
# (Fig. 6-7: success, and the guided half against the free half); then what the method changes over training.
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("success", (("success", "-"),), "success rate"),
    (
        "success: guided (solid) vs free (dashed) half",
        (("success/guided", "-"), ("success/free", "--")),
        "success rate",
    ),
    ("actions per episode", (("actions_per_episode", "-"),), "actions"),
    ("experience bank size", (("bank/size", "-"),), "entries"),
    ("extractor reward (steps with an update)", (("extractor/reward_mean", "-"),), "mean entry reward"),
    ("invalid actions per episode", (("invalid_per_episode", "-"),), "invalid actions"),
)


def smooth(values, window: int) -> np.ndarray:
    """Trailing moving average over logged points: ``out[i] = mean(values[max(0, i - window + 1) : i + 1])``
    (the first points average what exists, so the curve starts at the first step). ``[N] -> [N]``."""
    v = np.asarray(values, dtype=np.float64)
    if window <= 1 or v.size == 0:
        return v
    c = np.concatenate([[0.0], np.cumsum(v)])
    idx = np.arange(v.size)
    lo = np.maximum(0, idx - window + 1)
    return (c[idx + 1] - c[lo]) / (idx + 1 - lo)


def seed_curve(series, window: int) -> dict[str, np.ndarray] | None:
    """Seeds of one method as one curve: each seed smoothed, then, per step, the mean over the seeds that logged
    it and the standard error (sample std (n - 1) / sqrt(n); NaN where fewer than two seeds).

    Args:
      series: per seed, ``(steps [N_i], values [N_i])``.
    Returns:
      ``{"steps", "mean", "stderr", "raw", "n"}``, each ``[S]`` over the union of the seeds' steps (``raw``: the
      unsmoothed mean over seeds), or None when no seed logged the metric.
    """
    series = [(np.asarray(s), np.asarray(v, dtype=np.float64)) for s, v in series if len(s)]
    if not series:
        return None
    steps = np.unique(np.concatenate([s for s, _ in series]))
    smoothed = np.full((len(series), steps.size), np.nan)
    raw = np.full((len(series), steps.size), np.nan)
    for i, (s, v) in enumerate(series):
        pos = np.searchsorted(steps, s)
        smoothed[i, pos] = smooth(v, window)
        raw[i, pos] = v
    n = np.sum(~np.isnan(smoothed), axis=0)
    mean = np.nanmean(smoothed, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        std = np.sqrt(np.nansum((smoothed - mean) ** 2, axis=0) / (n - 1))
        stderr = np.where(n >= 2, std / np.sqrt(n), np.nan)
    return {"steps": steps, "mean": mean, "stderr": stderr, "raw": np.nanmean(raw, axis=0), "n": n}


def _series(path: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [r for r in read_jsonl(path) if key in r]
    return np.array([r["step"] for r in rows]), np.array([r[key] for r in rows], dtype=np.float64)


def curves_figure(runs: Mapping[str, str | Iterable[str]], smooth_window: int = 5, panels=PANELS):
    """The figure of :func:`plot_curves` (returned for inspection; the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {label: [paths] if isinstance(paths, str) else list(paths) for label, paths in runs.items()}
    cols = 3
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.2 * cols, 3.7 * rows_n), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys, ylabel) in zip(axes.flat, panels, strict=False):
        drawn = False
        for g, (label, paths) in enumerate(groups.items()):
            color = colors[g % len(colors)]
            for key, style in keys:
                cur = seed_curve([_series(p, key) for p in paths], smooth_window)
                if cur is None:
                    continue
                drawn = True
                n_seeds = len(paths)
                name = label + (f" ({n_seeds} seeds, mean ± s.e.)" if n_seeds > 1 else "")
                if len(keys) > 1:
                    name += f" {key.split('/')[-1]}"
                # Raw points faint behind the smoothed line; seeds as a band.
                ax.plot(
                    cur["steps"],
                    cur["raw"],
                    style,
                    color=color,
                    alpha=0.25,
                    lw=0.8,
                    marker=".",
                    ms=3,
                    zorder=1,
                )
                ax.plot(cur["steps"], cur["mean"], style, color=color, lw=1.8, label=name, zorder=3)
                if np.any(np.isfinite(cur["stderr"])):
                    ax.fill_between(
                        cur["steps"],
                        cur["mean"] - cur["stderr"],
                        cur["mean"] + cur["stderr"],
                        color=color,
                        alpha=0.2,
                        lw=0,
                        zorder=2,
                    )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(
            f"step  (lines: mean of the last {smooth_window} logged points; faint: raw)", fontsize=8
        )
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_curves(runs: Mapping[str, str | Iterable[str]], out_png: str, smooth: int = 5, panels=PANELS) -> str:
    """Training curves (the paper's Fig. 6-7 comparison): success, guided vs free half, actions per episode,
    bank size, extractor reward, invalid actions.

    Args:
      runs: label (e.g. the method) -> a metrics.jsonl path, or the paths of several seeds (drawn as their mean
        with a mean ± standard error band). Methods share the axes.
      out_png: output path.
      smooth: trailing moving-average window, in logged points (written on every x axis).
    """
    import matplotlib.pyplot as plt

    fig = curves_figure(runs, smooth, panels)
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
