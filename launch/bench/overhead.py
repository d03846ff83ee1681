"""Rollout wall time of Complementary RL vs the outcome-only baseline on the same `:tiny` config (issue 7).

  python launch/bench/overhead.py [--warmup=3 --steps=5] [--devices=8] [--distill_overlap=auto|rollout|update]

Builds both trainers in one process (same seed, same tasks, same tiny actor), runs them in alternation so that
machine load hits both alike, drops each one's warm-up steps (compilation), and prints one JSON line:
{"bench": "overhead", "crl_rollout_s", "baseline_rollout_s", "ratio", "split": {...}} where ratio is the mean
rollout time per step of Complementary RL divided by the baseline's (paper: 0.98-1.00x; target <= 1.05), and
split is Complementary RL's mean time per step in rollout / actor update / extraction / waiting for the background
distillation (``time/distill_wait_s``: the part of it the next rollout did not hide); ``step_ratio``: whole
``train_step`` wall time, Complementary RL over the baseline. ``search_ms`` and
``search_ask_ms``: p50 / p99 over the measured steps of one retrieval batch (the guided episodes' starts) and of
one search & ask call (retrieval plus the extractor's answer).

``--devices=8``: 8 fake CPU devices, the actor on 4 and the extractor on the other 4 (``mesh.placement=disjoint``,
a (data 2, tensor 2) mesh per role, as tests/test_placement.py): the extractor's updates run during the next
rollout and search & ask is answered on the continuous engine's ask thread. On this 2-core CPU the fake devices
share the cores, so this measures the schedule (what waits for what), not accelerator parallelism.
"""

import json
import os
import sys
import tempfile
import time

from absl import app, flags

_STEPS = flags.DEFINE_integer("steps", 5, "measured steps per method")
_WARMUP = flags.DEFINE_integer(
    "warmup", 3, "unmeasured steps per method first (compilation of the shape buckets)"
)
_OVERLAP = flags.DEFINE_enum(
    "distill_overlap", "auto", ["auto", "rollout", "update"], "extractor.distill_overlap for Complementary RL"
)
_DEVICES = flags.DEFINE_integer("devices", 0, "fake CPU devices (8: disjoint placement, 4 per role); 0: one")


def main(argv):
    del argv
    if _DEVICES.value:  # before JAX starts
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES.value}"
        )
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
    from trainer_helpers import load_config

    from comprl_jax.loop.trainer import Trainer

    total = _WARMUP.value + _STEPS.value
    over = {
        "train.steps": total,
        "rollout.tasks_per_step": 2,
        "env.max_turns": 6,
        "extractor.distill_overlap": _OVERLAP.value,
    }
    if _DEVICES.value:
        over.update(
            {
                "mesh.num_devices": _DEVICES.value,
                "mesh.placement": "disjoint",
                "mesh.data": 2,
                "mesh.tensor": 2,
                "actor.micro_batch": 4,
                "extractor.micro_batch": 2,
            }
        )
    runs = {}
    for method in ("complementary", "baseline"):
        variant = "tiny" if method == "complementary" else "tiny,baseline"
        runs[method] = Trainer(load_config("minihack_room", variant, **over), tempfile.mkdtemp())
    times = {m: [] for m in runs}
    turns = {m: [] for m in runs}
    split = {"rollout_s": [], "update_s": [], "extraction_s": [], "distill_wait_s": []}
    steps = {m: [] for m in runs}  # whole train_step wall time
    try:
        track = runs["complementary"].track
        marks = (0, 0)
        for i in range(total):
            if i == _WARMUP.value:  # latencies of the measured steps only
                marks = (len(track.search_ms), len(track.ask_ms))
            for method, tr in runs.items():
                t0 = time.perf_counter()
                m = tr.train_step()
                steps[method].append(time.perf_counter() - t0)
                times[method].append(m["time/rollout_s"])
                turns[method].append(
                    m["actions_per_episode"]
                    * len(tr.config.env.tasks)
                    * tr.config.rollout.tasks_per_step
                    * tr.config.rollout.group_size
                )
                if method == "complementary":
                    for k in split:
                        split[k].append(m[f"time/{k}"])
        searches = {"search_ms": track.search_ms[marks[0] :], "search_ask_ms": track.ask_ms[marks[1] :]}
    finally:
        for tr in runs.values():
            tr.close()

    def mean(xs):
        xs = xs[_WARMUP.value :]
        return sum(xs) / len(xs)

    crl, base = mean(times["complementary"]), mean(times["baseline"])
    # A random tiny actor's episodes end at different turns in the two runs, so time per actor turn (one
    # generation + one env step for every live episode) is the like-for-like figure; both are printed.
    w = _WARMUP.value
    crl_t = sum(times["complementary"][w:]) / sum(turns["complementary"][w:])
    base_t = sum(times["baseline"][w:]) / sum(turns["baseline"][w:])
    print(
        json.dumps(
            {
                "bench": "overhead",
                "config": "minihack_room:tiny",
                "steps": _STEPS.value,
                "crl_rollout_s": round(crl, 3),
                "baseline_rollout_s": round(base, 3),
                "ratio": round(crl / base, 3),
                "crl_s_per_turn": round(crl_t, 5),
                "baseline_s_per_turn": round(base_t, 5),
                "ratio_per_turn": round(crl_t / base_t, 3),
                "crl_step_s": round(mean(steps["complementary"]), 3),
                "baseline_step_s": round(mean(steps["baseline"]), 3),
                "step_ratio": round(mean(steps["complementary"]) / mean(steps["baseline"]), 3),
                "split": {k: round(mean(v), 3) for k, v in split.items()},
                "devices": _DEVICES.value or 1,
                "distill_overlap": _OVERLAP.value,
                **{
                    k: {"p50": _pct(v, 50), "p99": _pct(v, 99), "n": len(v)} if v else None
                    for k, v in searches.items()
                },
            }
        )
    )


def _pct(xs, q):
    import numpy as np

    return round(float(np.percentile(xs, q)), 2)


if __name__ == "__main__":
    app.run(main)
