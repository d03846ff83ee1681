"""XLA's buffer plan of a role's update step: temporaries per (micro_batch, logits_chunk), nothing run.

  python launch/bench/update_memory.py --config=configs/minihack_room.py:smollm --rows=32 --seq_len=4096 \\
      --settings=8/2048,4/512

Builds the role as the trainer does (``roles.build_role`` from the config's ``actor`` / ``extractor`` section and
its loss) for each ``micro_batch/logits_chunk`` pair, compiles the update for ``rows`` rows of ``seq_len`` tokens and
the pi_old log-prob pass over the same rows, and prints one JSON line per pair: ``update_temp_gb`` (XLA's
temporaries, which include the micro-batch's activations and the output head's logits), ``update_args_gb`` (train
state + batch), ``logprob_temp_gb``. Compile-only, so a 135M model at 32 x 4,096 takes seconds per pair on a CPU.
Pick the smallest-temporaries setting that keeps the step fast; the values are the same either way.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
from absl import app, flags

from comprl_jax import config as config_lib

_CONFIG = flags.DEFINE_string("config", "configs/minihack_room.py:smollm", "config file[:variant]")
_ROLE = flags.DEFINE_enum("role", "actor", ["actor", "extractor"], "which role's update")
_ROWS = flags.DEFINE_integer("rows", 32, "rows of one optimizer step")
_SEQ = flags.DEFINE_integer("seq_len", 4096, "padded tokens per row")
_SETTINGS = flags.DEFINE_string("settings", "8/2048,4/512", "comma-separated micro_batch/logits_chunk pairs")

GB = 1e9


def batch(rows: int, t: int, role: str) -> dict[str, np.ndarray]:
    """An update batch of the loss batch layout (``rl/losses.py``); values do not change the plan."""
    b = {
        "tokens": np.zeros((rows, t), np.int32),
        "positions": np.tile(np.arange(t, dtype=np.int32), (rows, 1)),
        "attn_mask": np.ones((rows, t), bool),
        "loss_mask": np.ones((rows, t), np.float32),
        "old_logprobs": np.zeros((rows, t), np.float32),
        "advantages": np.ones((rows,), np.float32),
    }
    if role == "actor":
        b["subgroup"] = np.zeros((rows,), np.int32)
    else:
        b["sample_weight"] = np.ones((rows,), np.float32)
    return b


def main(argv):
    del argv
    from comprl_jax.config.run import RunConfig
    from comprl_jax.models.zoo import load_model
    from comprl_jax.roles import role as roles

    c = config_lib.load_file(_CONFIG.value)
    role_name = _ROLE.value
    model = load_model(
        c[role_name].model,
        role=role_name,
        tokenizer=None,
        seed=0,
        mesh=None,
        param_dtype=c[role_name].param_dtype,
        dtype=c[role_name].dtype,
    )
    b = batch(_ROWS.value, _SEQ.value, role_name)
    model_in = {k: b[k] for k in ("tokens", "positions", "attn_mask", "loss_mask")}
    for pair in _SETTINGS.value.split(","):
        mb, chunk = (int(x) for x in pair.split("/"))
        section = dataclasses.replace(getattr(RunConfig.of(c), role_name), micro_batch=mb, logits_chunk=chunk)
        role = roles.build_role(model, role_name, section, section.loss, _ROWS.value)
        t0 = time.perf_counter()
        upd = role.update.lower(role.state, b).compile().memory_analysis()
        lp = role.logprobs.lower(role.state.params, model_in).compile().memory_analysis()
        print(
            json.dumps(
                {
                    "bench": "update_memory",
                    "config": _CONFIG.value,
                    "role": role_name,
                    "rows": _ROWS.value,
                    "seq_len": _SEQ.value,
                    "micro_batch": mb,
                    "logits_chunk": chunk,
                    "remat": bool(section.remat),
                    "update_temp_gb": round(upd.temp_size_in_bytes / GB, 3),
                    "update_args_gb": round(upd.argument_size_in_bytes / GB, 3),
                    "logprob_temp_gb": round(lp.temp_size_in_bytes / GB, 3),
                    "compile_s": round(time.perf_counter() - t0, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
