"""A run around the trainer: resume, the step loop with its metrics rows, evaluations and checkpoints, the
end-of-run evaluation, plot and replica digests (``launch/train.py`` calls :func:`run`).

Metrics rows are written once complete: with disjoint placement a step's extractor updates may still be in flight
when the step returns, and their metrics land in the same row (the trainer joins them at the next rollout, a
checkpoint, an evaluation or the end).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax

from comprl_jax.loop.trainer import Trainer
from comprl_jax.runtime import distributed as dist
from comprl_jax.runtime import metrics as mlib


def _eval_metrics(ev: dict) -> dict[str, float]:
    """``eval/<label>/<with|without>_exp`` success rates for a metrics row (train.eval_every), and the same
    keys under ``eval_score/`` and ``eval_actions/`` (the env's graded score, actions per episode)."""
    out = {}
    for mode, rows in ev.items():
        for label, r in rows.items():
            name = f"{label.split('/')[-1]}/{mode}"
            out[f"eval/{name}"] = r["success"]
            out[f"eval_score/{name}"] = r["score"]
            out[f"eval_actions/{name}"] = r["actions"]
    return out


def run(
    config,
    workdir: str,
    *,
    progress: bool = True,
    stop_after: int | None = None,
    row_extra: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Trains ``config`` in ``workdir`` (auto-resume), evaluates at the end, writes metrics, plot and eval.json.

    Args:
      stop_after: stop (with a checkpoint) after this many steps of *this* invocation (tests, preemption drills).
      row_extra: scalars merged into the first metrics row this invocation writes (e.g. ``config_changed``).
    Returns:
      ``{"step", "last_metrics", "eval"}``.
    """
    os.makedirs(workdir, exist_ok=True)
    if dist.is_leader():
        write_config(config, workdir)
    tr = Trainer(config, workdir)
    bar = None
    try:
        resumed = tr.restore()
        if tr.offline and not tr.offline_built:
            tr.build_offline_bank()
        writer = mlib.MetricsWriter(workdir, resume_step=tr.step if resumed else 0)
        mlib.start_memory_tracking()
        if progress and tr.leader:
            from tqdm import tqdm

            bar = tqdm(total=tr.config.train.steps, initial=tr.step, desc=tr.config.experiment, unit="step")
        last, done_here = _steps(tr, writer, bar, stop_after, row_extra)
        tr.save(force=True)
        writer.flush()
        if not last and tr.leader and os.path.exists(writer.path):  # nothing ran here: the run's last row
            recorded = mlib.read_jsonl(writer.path)
            last = recorded[-1] if recorded else {}
        result: dict[str, Any] = {"step": tr.step, "last_metrics": last}
        if tr.step >= tr.config.train.steps:
            result["eval"] = final_evaluation(tr, workdir, writer.path, ran_here=done_here > 0)
        digests = write_digests(tr, workdir)
        if digests is not None:
            result["digests"] = digests
        writer.close()
        return result
    finally:
        if bar is not None:  # (closed before an error message, not redrawn after it)
            bar.close()
        tr.close()


def _steps(tr: Trainer, writer, bar, stop_after: int | None, row_extra: dict | None) -> tuple[dict, int]:
    """Train steps until ``train.steps`` (or ``stop_after`` steps of this invocation): evaluations every
    ``train.eval_every``, a metrics row every ``train.log_every`` written once complete, checkpoints when due.
    Returns ``(the last row written, steps run here)``."""
    t = tr.config.train
    last: dict[str, float] = {}
    done_here = 0
    rows: list[tuple[int, dict]] = []  # written once complete (an extractor update may still be in flight)
    while tr.step < t.steps:
        t0 = time.perf_counter()
        s = tr.step
        eval_now = bool(t.eval_every) and (s + 1) % t.eval_every == 0
        eval_now = eval_now and s + 1 < t.steps  # (the final evaluation follows the loop)
        log_row = s % t.log_every == 0 or s + 1 >= t.steps or eval_now
        metrics = tr.train_step(fetch=log_row)
        metrics["time/step_s"] = time.perf_counter() - t0
        mem = mlib.device_memory_mb()
        if mem is not None:
            metrics["device_mem_mb"] = mem
        if eval_now:
            metrics.update(_eval_metrics(tr.evaluate_modes(t.eval_tasks)))
        if log_row:
            rows.append((s, metrics))
        done_here += 1
        if bar is not None:
            bar.update(1)
        stopping = tr.step >= t.steps or (stop_after is not None and done_here >= stop_after)
        if stopping or tr.save_due():
            tr.join_extractor()
        ready = rows if not tr.extractor_pending else rows[:-1]
        for step_i, r in ready:
            if row_extra:
                r, row_extra = {**r, **row_extra}, None
            last = writer.write(step_i, r)
            if bar is not None:
                bar.set_postfix(success=f"{r['success']:.2f}", bank=int(r.get("bank/size", 0)))
        rows = rows[len(ready) :]
        tr.save()
        if stopping:
            break
    return last, done_here


def write_config(config, workdir: str) -> None:
    """``config.json``, atomically: a crash never leaves a torn file."""
    tmp = os.path.join(workdir, "config.json.tmp")
    with open(tmp, "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    os.replace(tmp, os.path.join(workdir, "config.json"))


def final_evaluation(tr: Trainer, workdir: str, metrics_path: str, *, ran_here: bool) -> dict:
    """The end-of-run evaluation (``eval.json``) and ``curves.png``. A finished run relaunched (nothing
    ``ran_here``) returns the evaluation already on disk instead of playing it again."""
    eval_path = os.path.join(workdir, "eval.json")
    if not ran_here and os.path.exists(eval_path):
        with open(eval_path) as f:
            return json.load(f)
    ev = tr.evaluate_modes(tr.config.train.eval_tasks)
    if tr.leader:
        with open(eval_path, "w") as f:
            json.dump(ev, f, indent=2)
        mlib.plot_curves({tr.config.method: metrics_path}, os.path.join(workdir, "curves.png"))
    return ev


def write_digests(tr: Trainer, workdir: str) -> dict | None:
    """Every process writes its replicas' digests (``digest_p<i>.json``): identical files = identical
    parameters, banks and buffers. Skipped (None) past 1 GiB of parameters: a digest copies every replica to
    the host."""
    if tr.param_bytes() > 2**30:
        return None
    digests = tr.digests()
    with open(os.path.join(workdir, f"digest_p{jax.process_index()}.json"), "w") as f:
        json.dump(digests, f, indent=2)
    return digests
