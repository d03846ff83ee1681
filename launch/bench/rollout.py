"""Multi-turn rollout benchmark with heterogeneous reply lengths (issue 17, item 1): where a rollout's time goes.

  python launch/bench/rollout.py                      # tiny random-init Qwen3, 32 episodes x 6 turns, MiniHack steps
  python launch/bench/rollout.py --slots=64 --turns=8 --env_workers=4

Workload (the same for every engine, fixed by ``--seed``): ``--slots`` episodes play ``--turns`` turns each. Every
reply has a scripted length drawn once from a log-normal between ``--min_reply`` and ``--max_reply`` tokens (a few
tokens to a few hundred, like thinking replies of very different lengths); the model samples with no stop token, so
each row generates exactly its scripted length (``Conversation.turn(max_new=...)``). Between turns each episode
takes a real env step on the env pool (MiniHack Room-5x5 by default, a random action) and appends an observation
of ``--obs_tokens`` ids.

One JSON line per engine, ``bench: "rollout"``:

* ``useful_tokens``: generated tokens the workload asks for; ``tokens_s``: useful tokens / rollout wall time;
* ``decode_steps``: sum over sampler calls of the decode positions the call ran (its longest row);
  ``slot_utilisation``: useful tokens / (decode steps x slots), 1.0 = no slot ever idles;
* ``gen_s`` / ``env_s``: time in sampler calls / in env steps; ``device_busy_fraction``: gen_s / wall;
  ``env_hidden_s``: gen_s + env_s - wall (env time that overlapped decoding; 0 when they alternate);
* ``speedup_vs_lockstep``: the lock-step engine's wall time / this engine's.

Today's engine is ``lockstep`` (``rollout.run_episodes``: one sampler call per turn for every live row, which runs
until its longest reply ends, then every env step while the device waits). The continuous-batching engine and the
peers (Tunix's sampler, llama.cpp, the decode roofline) join this script as they land.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import app, flags

_SLOTS = flags.DEFINE_integer("slots", 32, "episodes played at once (KV-cache rows)")
_TURNS = flags.DEFINE_integer("turns", 6, "turns per episode")
_MIN = flags.DEFINE_integer("min_reply", 4, "shortest scripted reply (tokens)")
_MAX = flags.DEFINE_integer("max_reply", 256, "longest scripted reply (tokens)")
_OBS = flags.DEFINE_integer("obs_tokens", 48, "observation tokens appended per turn")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 256, "first prompt (system + first observation) tokens")
_ENV = flags.DEFINE_string("env", "comprl/MiniHack-Room-5x5-v0", "env id stepped between turns ('' = none)")
_ENV_WORKERS = flags.DEFINE_integer("env_workers", 2, "env pool threads")
_SEED = flags.DEFINE_integer("seed", 0, "workload seed")
_EMIT = flags.DEFINE_boolean(
    "emit_lengths", False, "add the scripted lengths [turns][slots] to each line (tests)"
)


def reply_lengths(rng: np.random.Generator, slots: int, turns: int, lo: int, hi: int) -> np.ndarray:
    """``[turns, slots]`` scripted reply lengths: log-normal (median ~ geometric mean of lo and hi), clipped."""
    mu = 0.5 * (np.log(lo) + np.log(hi))
    sigma = (np.log(hi) - np.log(lo)) / 4
    return np.clip(np.round(rng.lognormal(mu, sigma, size=(turns, slots))), lo, hi).astype(np.int32)


def tiny_model():
    from comprl_jax.models import ModelConfig, init_decoder

    cfg = ModelConfig.tiny(
        "qwen3",
        vocab_size=2048,
        num_layers=4,
        hidden_size=256,
        intermediate_size=768,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
    )
    graphdef, params = init_decoder(cfg, seed=0)
    return graphdef, params, cfg


def run_lockstep(svc, lengths: np.ndarray, pool, rng: np.random.Generator, actions) -> dict:
    """Today's engine, as ``rollout.run_episodes`` drives it: one call per turn, then every env step."""
    from comprl_jax.sampling import SamplingParams

    turns, slots = lengths.shape
    vocab = svc.cfg.vocab_size
    sp = SamplingParams(max_new_tokens=int(lengths.max()), temperature=1.0)
    conv = svc.conversation(
        batch=slots, max_len=_PROMPT.value + turns * (_OBS.value + int(lengths.max())) + 16
    )
    if pool is not None:
        for s in range(slots):
            pool.submit_reset(s, s).result()
    pending = [rng.integers(10, vocab, _PROMPT.value).tolist() for _ in range(slots)]
    key = jax.random.key(0)
    gen_s = env_s = 0.0
    steps = 0
    t_start = time.perf_counter()
    for t in range(turns):
        t0 = time.perf_counter()
        res = conv.turn(pending, jax.random.fold_in(key, t), sp, max_new=lengths[t].tolist())
        t1 = time.perf_counter()
        gen_s += t1 - t0
        steps += int(res.steps)
        assert res.lengths.tolist() == lengths[t].tolist(), "a row did not generate its scripted length"
        if pool is not None:
            futs = [pool.submit_step(s, f"<answer>{rng.choice(actions)}</answer>") for s in range(slots)]
            for f in futs:
                f.result()
        env_s += time.perf_counter() - t1
        pending = [rng.integers(10, vocab, _OBS.value).tolist() for _ in range(slots)]
    wall = time.perf_counter() - t_start
    useful = int(lengths.sum())
    return {
        "engine": "lockstep",
        "useful_tokens": useful,
        "decode_steps": steps,
        "slot_utilisation": round(useful / max(steps * slots, 1), 4),
        "tokens_s": round(useful / wall, 1),
        "wall_s": round(wall, 3),
        "gen_s": round(gen_s, 3),
        "env_s": round(env_s, 3),
        "device_busy_fraction": round(gen_s / wall, 4),
        "env_hidden_s": round(max(gen_s + env_s - wall, 0.0), 3),
    }


def main(argv):
    del argv
    from comprl_jax.envs.pool import EnvPool
    from comprl_jax.sampling import SamplerService

    rng = np.random.default_rng(_SEED.value)
    lengths = reply_lengths(rng, _SLOTS.value, _TURNS.value, _MIN.value, _MAX.value)
    graphdef, params, cfg = tiny_model()
    svc = SamplerService(graphdef, params, cfg, stop_token_ids=(), pad_id=0)
    pool, actions = None, ()
    if _ENV.value:
        from comprl_jax.envs import registry

        pool = EnvPool(
            _ENV.value, _SLOTS.value, num_workers=_ENV_WORKERS.value, env_kwargs={"max_turns": 10**6}
        )
        env = registry.make(_ENV.value)
        actions = tuple(env.actions)
        env.close()
    common = {
        "bench": "rollout",
        "model": "tiny-qwen3-4L-256",
        "slots": _SLOTS.value,
        "turns": _TURNS.value,
        "reply_tokens": [int(lengths.min()), int(np.median(lengths)), int(lengths.max())],
        "env": _ENV.value or None,
        "backend": jax.default_backend(),
    }
    if _EMIT.value:
        common["lengths"] = lengths.tolist()
    try:
        # A warm-up pass compiles every bucket the measured pass uses (same shapes, same lengths).
        run_lockstep(svc, lengths, pool, np.random.default_rng(_SEED.value + 1), actions)
        base = run_lockstep(svc, lengths, pool, np.random.default_rng(_SEED.value + 1), actions)
        print(json.dumps({**common, **base, "speedup_vs_lockstep": 1.0}), flush=True)
    finally:
        if pool is not None:
            pool.close()


if __name__ == "__main__":
    app.run(main)
