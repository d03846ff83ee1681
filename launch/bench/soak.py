"""Soak: many `:tiny` training steps in one process; resident memory must plateau and the bank stay in its cap.

  python launch/bench/soak.py [--steps=200 --warmup=20 --capacity=40]

Prints one JSON line {"bench": "soak", "steps", "rss_warm_mb", "rss_end_mb", "rss_growth", "bank_max",
"bank_capacity", ...}: rss_growth = end / after-warm-up - 1 (target <= 0.10). The bank capacity is set small so
FIFO eviction and merges run many times during the soak.
"""

import json
import os
import sys
import tempfile
import time

import psutil
from absl import app, flags

_STEPS = flags.DEFINE_integer("steps", 200, "training steps")
_WARMUP = flags.DEFINE_integer("warmup", 20, "steps before the reference RSS reading")
_CAPACITY = flags.DEFINE_integer("capacity", 40, "bank capacity during the soak")


def main(argv):
    del argv
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
    from trainer_helpers import load_config

    from comprl_jax.loop.trainer import Trainer
    from comprl_jax.runtime import metrics as mlib

    c = load_config(
        "minihack_room",
        "tiny",
        **{
            "train.steps": _STEPS.value,
            "bank.capacity": _CAPACITY.value,
            "rollout.tasks_per_step": 2,
            "extractor.buffer.batch_size": 4,
        },
    )
    workdir = tempfile.mkdtemp()
    proc = psutil.Process()
    tr = Trainer(c, workdir)
    writer = mlib.MetricsWriter(workdir)
    rss_warm, bank_max, t0 = None, 0, time.time()
    try:
        for step in range(_STEPS.value):
            m = tr.train_step()
            writer.write(step, m)
            tr.save()
            bank_max = max(bank_max, int(m.get("bank/size", 0)))
            if step + 1 == _WARMUP.value:
                rss_warm = proc.memory_info().rss
        rss_end = proc.memory_info().rss
    finally:
        writer.close()
        tr.close()
    print(
        json.dumps(
            {
                "bench": "soak",
                "steps": _STEPS.value,
                "warmup": _WARMUP.value,
                "rss_warm_mb": round(rss_warm / 2**20, 1),
                "rss_end_mb": round(rss_end / 2**20, 1),
                "rss_growth": round(rss_end / rss_warm - 1, 4),
                "bank_max": bank_max,
                "bank_capacity": _CAPACITY.value,
                "minutes": round((time.time() - t0) / 60, 1),
            }
        )
    )


if __name__ == "__main__":
    app.run(main)
