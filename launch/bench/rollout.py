"""Multi-turn rollout benchmark with heterogeneous reply lengths (issue 17): where a rollout's time goes, lock-step
vs continuous batching, and the decode roofline.

  python launch/bench/rollout.py                     # tiny random-init Qwen3, 48 episodes x 4 turns on 16 slots
  python launch/bench/rollout.py --slots=32 --episodes=128 --turns=6 --env_workers=4

Workload (the same for every engine, fixed by ``--seed``): ``--episodes`` episodes play ``--turns`` turns each on
``--slots`` KV-cache rows. Every reply has a scripted length drawn once from a log-normal between ``--min_reply``
and ``--max_reply`` tokens (a few tokens to a few hundred, like thinking replies of very different lengths). The
model samples with no stop token, so each row generates exactly its scripted length. Between turns each episode
takes a real env step on the env pool (MiniHack Room-5x5 by default, a random action) and appends an observation
of ``--obs_tokens`` ids.

Engines, one JSON line each (``bench: "rollout"``, ``engine``):

* ``lockstep``: ``rollout.run_episodes``'s schedule. The episodes play in waves of ``--slots`` rows (the same KV
  memory as the slot engine). Each turn is one sampler call that runs until the wave's longest reply ends, then
  every env step runs while the device waits.
* ``continuous``: ``slot_rollout.schedule`` on ``sampling.slots.SlotBatch``, the trainer's default engine.
  Episodes take free slots as others end, and each reply's env step runs on the pool while the other slots decode.

Figures: ``useful_tokens`` (generated tokens the workload asks for), ``tokens_s`` (useful tokens / wall),
``decode_steps`` (decode positions the engine ran; a prefill call that samples counts as one) and
``slot_utilisation`` (useful tokens / sum over decode steps of the slots they ran on; 1.0 = no slot ever idles; the
continuous engine's batch shrinks in a rollout's tail). Also ``gen_s`` / ``env_s``
(time in sampler calls / waiting for env steps), ``device_busy_fraction`` (lock-step: gen_s / wall; continuous:
1 - an upper bound of device idle / wall), ``env_hidden_s`` (env step time that ran while the device decoded) and
``speedup_vs_lockstep`` (lock-step wall / this engine's wall).

``overlap`` line: a second workload where env time is as large as generation time. Each env step also sleeps
``d``, with ``d`` chosen so that the env steps alone take as long as generation alone. It reports
``wall_s / max(gen_only_s, env_only_s)`` as ``overlap_ratio`` (target <= 1.1). ``gen_only_s`` is the continuous
engine with no env; ``env_only_s`` is every env step on the same workers with no generation.

``peer: "roofline"`` line: the decode roofline. Per decode step, the weights are read once and every live row's KV
is read once; the bytes follow from the workload and the memory bandwidth is measured in the same run (a jitted
reduction over a 512 MiB array). ``ratio`` = our tokens/s / the roofline's.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags (only when run as a script: importing it defines none)."""
    flags.DEFINE_integer("slots", 16, "KV-cache rows of each engine")
    flags.DEFINE_integer(
        "episodes", 48, "episodes of the workload (lock-step plays them in waves of --slots)"
    )
    flags.DEFINE_integer("turns", 4, "turns per episode")
    flags.DEFINE_integer("min_reply", 4, "shortest scripted reply (tokens)")
    flags.DEFINE_integer("max_reply", 256, "longest scripted reply (tokens)")
    flags.DEFINE_integer("obs_tokens", 48, "observation tokens appended per turn")
    flags.DEFINE_integer("prompt_tokens", 256, "first prompt (system + first observation) tokens")
    flags.DEFINE_string("env", "comprl/MiniHack-Room-5x5-v0", "env id stepped between turns ('' = none)")
    flags.DEFINE_integer("env_workers", 2, "env pool threads")
    flags.DEFINE_integer("chunk_steps", 16, "continuous engine: decode positions per call at most")
    flags.DEFINE_float(
        "exit_frac", 0.125, "continuous engine: a call ends once this fraction of slots finished"
    )
    flags.DEFINE_boolean("overlap", True, "also run the env-as-large-as-generation workload (overlap line)")
    flags.DEFINE_integer("seed", 0, "workload seed")
    flags.DEFINE_boolean(
        "emit_lengths", False, "add the scripted lengths [turns][episodes] to each line (tests)"
    )


def reply_lengths(rng: np.random.Generator, episodes: int, turns: int, lo: int, hi: int) -> np.ndarray:
    """``[turns, episodes]`` scripted reply lengths: log-normal (median ~ geometric mean of lo and hi), clipped."""
    mu = 0.5 * (np.log(lo) + np.log(hi))
    sigma = (np.log(hi) - np.log(lo)) / 4
    return np.clip(np.round(rng.lognormal(mu, sigma, size=(turns, episodes))), lo, hi).astype(np.int32)


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


class Workload:
    """The scripted episodes: prompts, observations and reply lengths, identical for every engine."""

    def __init__(self, lengths: np.ndarray, vocab: int, prompt: int, obs: int, seed: int):
        self.lengths = lengths
        self.turns, self.episodes = lengths.shape
        rng = np.random.default_rng(seed)
        self.prompts = [rng.integers(10, vocab, prompt).tolist() for _ in range(self.episodes)]
        self.obs = [
            [rng.integers(10, vocab, obs).tolist() for _ in range(self.turns)] for _ in range(self.episodes)
        ]
        self.max_len = prompt + self.turns * (obs + int(lengths.max())) + 16

    def input(self, b: int, t: int) -> list[int]:
        return self.prompts[b] if t == 0 else self.obs[b][t]


class Env:
    """Env steps on the pool (a random action each), optionally with an extra ``delay_s`` sleep per step (a slower
    env); ``busy_s`` sums every step's duration, as its worker saw it."""

    def __init__(self, pool, actions, workers: int, delay_s: float = 0.0):
        self.pool, self.actions, self.delay_s = pool, actions, delay_s
        # At most `workers` steps in flight (one per pool worker), so a step's duration excludes queueing.
        self.exec = concurrent.futures.ThreadPoolExecutor(workers)
        self.busy_s = 0.0
        self.rng = np.random.default_rng(0)

    def reset(self, episodes: int) -> None:
        if self.pool is not None:
            for f in [self.pool.submit_reset(b, b) for b in range(episodes)]:
                f.result()

    def submit(self, b: int):
        if self.pool is None:
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
        action = f"<answer>{self.rng.choice(self.actions)}</answer>"

        def step():
            t0 = time.perf_counter()
            if self.delay_s:
                time.sleep(self.delay_s)
            out = self.pool.submit_step(b, action).result()
            self.busy_s += time.perf_counter() - t0
            return out

        return self.exec.submit(step)

    def close(self):
        self.exec.shutdown()


def run_lockstep(svc, w: Workload, env: Env, slots: int) -> dict:
    """``rollout.run_episodes``'s schedule in waves of ``slots`` rows: one call per turn, then every env step."""
    from comprl_jax.sampling import SamplingParams

    sp = SamplingParams(max_new_tokens=int(w.lengths.max()), temperature=1.0)
    key = jax.random.key(0)
    gen_s = env_s = 0.0
    steps = slot_steps = 0
    env.reset(w.episodes)
    t_start = time.perf_counter()
    for lo in range(0, w.episodes, slots):
        rows = range(lo, min(lo + slots, w.episodes))
        conv = svc.conversation(batch=len(rows), max_len=w.max_len)
        for t in range(w.turns):
            t0 = time.perf_counter()
            want = [int(w.lengths[t, b]) for b in rows]
            res = conv.turn([w.input(b, t) for b in rows], jax.random.fold_in(key, t), sp, max_new=want)
            t1 = time.perf_counter()
            gen_s += t1 - t0
            steps += int(res.steps)
            slot_steps += int(res.steps) * len(rows)
            assert res.lengths.tolist() == want, "a row did not generate its scripted length"
            for f in [env.submit(b) for b in rows]:
                f.result()
            env_s += time.perf_counter() - t1
    wall = time.perf_counter() - t_start
    return _figures("lockstep", w, steps, slot_steps, wall, gen_s, env_s, gen_s / wall, 0.0)


def run_continuous(svc, w: Workload, env: Env, slots: int, chunk_steps: int, exit_frac: float) -> dict:
    """The trainer's continuous engine (``slot_rollout.schedule``) on the scripted workload."""
    from comprl_jax.sampling import SamplingParams
    from comprl_jax.sampling.slots import Entry, SlotBatch
    from comprl_jax.slot_rollout import _Context, schedule

    sp = SamplingParams(max_new_tokens=int(w.lengths.max()), temperature=1.0)
    engine = SlotBatch(svc, slots, w.max_len, sp, chunk_steps=chunk_steps)
    ctx = [_Context() for _ in range(w.episodes)]
    turn = [0] * w.episodes

    def entry(b):
        return Entry(-1, ctx[b].feed(w.input(b, turn[b])), False, int(w.lengths[turn[b], b]), (b, turn[b]))

    def on_replies(finished):
        out = {}
        for b, f in finished:
            assert len(f.tokens) == w.lengths[turn[b], b], "a row did not generate its scripted length"
            ctx[b].reply(f.tokens, f.logprobs)
            out[b] = env.submit(b)
        return out

    def on_result(b, _result):
        turn[b] += 1
        return turn[b] < w.turns

    env.reset(w.episodes)
    busy0 = env.busy_s
    t0 = time.perf_counter()
    timing = schedule(
        engine, jax.random.key(0), range(w.episodes), entry, on_replies, on_result, exit_frac=exit_frac
    )
    wall = time.perf_counter() - t0
    assert timing["generated"] == w.lengths.sum()
    env_total = (env.busy_s - busy0) / max(FLAGS.env_workers, 1)
    busy = 1.0 - timing["device_idle_s"] / wall
    hidden = max(env_total - timing["env_s"], 0.0) if env.pool is not None else 0.0
    return _figures(
        "continuous",
        w,
        int(timing["decode_steps"]),
        int(timing["slot_steps"]),
        wall,
        timing["gen_s"],
        timing["env_s"],
        busy,
        hidden,
    )


def _figures(engine, w, steps, slot_steps, wall, gen_s, env_s, busy, hidden) -> dict:
    useful = int(w.lengths.sum())
    return {
        "engine": engine,
        "useful_tokens": useful,
        "decode_steps": steps,
        "slot_utilisation": round(useful / max(slot_steps, 1), 4),
        "tokens_s": round(useful / wall, 1),
        "wall_s": round(wall, 3),
        "gen_s": round(gen_s, 3),
        "env_s": round(env_s, 3),
        "device_busy_fraction": round(busy, 4),
        "env_hidden_s": round(hidden, 3),
    }


def env_only(w: Workload, env: Env) -> float:
    """Every env step of the workload with no generation: each episode's turns in order, all episodes at once."""
    env.reset(w.episodes)
    t0 = time.perf_counter()
    for _t in range(w.turns):
        for f in [env.submit(b) for b in range(w.episodes)]:
            f.result()
    return time.perf_counter() - t0


def memory_bandwidth() -> float:
    """Bytes/s of a jitted read of a 512 MiB float32 array (best of 5), on the default device."""
    x = jnp.ones((128 * 2**20,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return x.size * 4 / best


def roofline_s(w: Workload, cfg, params, slots: int, bandwidth: float) -> float:
    """Decode time at the memory roofline: per step the weights once (``useful / slots`` steps: perfect packing)
    and, per generated token, its row's KV up to that position."""
    from comprl_jax.models.decoder import count_params

    kv_per_pos = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    kv = 0
    for b in range(w.episodes):
        pos = 0
        for t in range(w.turns):
            pos += len(w.input(b, t))
            n = int(w.lengths[t, b])
            kv += n * pos + n * (n - 1) // 2  # token i of the reply reads pos + i positions
            pos += n
    weights = count_params(params) * jnp.dtype(cfg.dtype).itemsize
    steps = w.lengths.sum() / slots
    return (kv * kv_per_pos + steps * weights) / bandwidth


def main(argv):
    del argv
    from comprl_jax.envs.pool import EnvPool
    from comprl_jax.sampling import SamplerService

    rng = np.random.default_rng(FLAGS.seed)
    lengths = reply_lengths(rng, FLAGS.episodes, FLAGS.turns, FLAGS.min_reply, FLAGS.max_reply)
    graphdef, params, cfg = tiny_model()
    svc = SamplerService(graphdef, params, cfg, stop_token_ids=(), pad_id=0)
    w = Workload(lengths, cfg.vocab_size, FLAGS.prompt_tokens, FLAGS.obs_tokens, FLAGS.seed + 1)
    pool, actions = None, ()
    if FLAGS.env:
        from comprl_jax.envs import registry

        pool = EnvPool(
            FLAGS.env, FLAGS.episodes, num_workers=FLAGS.env_workers, env_kwargs={"max_turns": 10**6}
        )
        env = registry.make(FLAGS.env)
        actions = tuple(env.actions)
        env.close()
    common = {
        "bench": "rollout",
        "model": "tiny-qwen3-4L-256",
        "slots": FLAGS.slots,
        "episodes": FLAGS.episodes,
        "turns": FLAGS.turns,
        "reply_tokens": [int(lengths.min()), int(np.median(lengths)), int(lengths.max())],
        "env": FLAGS.env or None,
        "backend": jax.default_backend(),
    }
    if FLAGS.emit_lengths:
        common["lengths"] = lengths.tolist()
    env = Env(pool, actions, FLAGS.env_workers)
    cont = lambda e: run_continuous(svc, w, e, FLAGS.slots, FLAGS.chunk_steps, FLAGS.exit_frac)  # noqa: E731
    try:
        # A warm-up pass compiles every bucket the measured pass uses (same shapes, same lengths).
        run_lockstep(svc, w, env, FLAGS.slots)
        base = run_lockstep(svc, w, env, FLAGS.slots)
        print(json.dumps({**common, **base, "speedup_vs_lockstep": 1.0}), flush=True)
        cont(env)
        ours = cont(env)
        speed = round(base["wall_s"] / ours["wall_s"], 3)
        print(json.dumps({**common, **ours, "speedup_vs_lockstep": speed}), flush=True)
        bw = memory_bandwidth()
        roof = roofline_s(w, cfg, params, FLAGS.slots, bw)
        print(
            json.dumps(
                {
                    **common,
                    "peer": "roofline",
                    "bandwidth_gb_s": round(bw / 1e9, 2),
                    "roofline_s": round(roof, 3),
                    "tokens_s": round(w.lengths.sum() / roof, 1),
                    "ratio": round(roof / ours["wall_s"], 4),
                }
            ),
            flush=True,
        )
        if FLAGS.overlap and pool is not None:
            none = Env(None, (), FLAGS.env_workers)
            gen_only = cont(none)["wall_s"]
            none.close()
            steps = w.episodes * w.turns
            base_env = env_only(w, env)
            # The sleep that makes env steps alone take as long as generation alone.
            delay = max(gen_only - base_env, 0.0) * FLAGS.env_workers / steps
            slow = Env(pool, actions, FLAGS.env_workers, delay_s=delay)
            env_s = env_only(w, slow)
            both = cont(slow)
            slow.close()
            print(
                json.dumps(
                    {
                        **common,
                        **both,
                        "workload": "overlap",
                        "env_delay_ms": round(delay * 1e3, 2),
                        "gen_only_s": round(gen_only, 3),
                        "env_only_s": round(env_s, 3),
                        "overlap_ratio": round(both["wall_s"] / max(gen_only, env_s), 3),
                    }
                ),
                flush=True,
            )
    finally:
        env.close()
        if pool is not None:
            pool.close()


if __name__ == "__main__":
    define_flags()
    app.run(main)
