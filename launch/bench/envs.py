"""Env throughput: one env stepped sequentially vs the async EnvPool. One JSON line per config.

COMMAND: .venv/bin/python launch/bench/envs.py [--steps 3000] [--repeats 3] [--only MiniHack] [--backend thread]
         .venv/bin/python launch/bench/envs.py --gil   (does NLE's step release the GIL? see ``gil_probe``)
         .venv/bin/python launch/bench/envs.py --webshop [--split eval]   (WebShop quality figures, ``webshop_figures``)
         .venv/bin/python launch/bench/envs.py --swe [--swe_tasks 0]   (SWE-Lite checks, ``swe_figures``)

Each line: {"bench": "envs", "env", "backend", "workers", "slots", "steps", "repeats", "seq_steps_s",
"pool_steps_s", "ratio", "ratios"}. Sequential and pool runs alternate ``repeats`` times (the machine's load moves
both alike) and the figures are medians; ``ratio`` is the median of the per-repeat ratios. Both sides play the same random policy over the env's admissible actions (resets included in the
time). The pool side keeps every slot busy by submitting a slot's next step from the previous step's
completion callback, so it measures env throughput, not a driver loop. To add an env (e.g. ALFWorld with the
process backend), append a ``bench_env(...)`` call to ``CONFIGS`` or call it from your own script.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from comprl_jax.envs import make  # noqa: E402
from comprl_jax.envs.pool import EnvPool  # noqa: E402

CONFIGS = [
    # (env_id, backend, workers, env_kwargs)
    ("comprl/MiniHack-Room-Ultimate-5x5-v0", "thread", 2, {}),
    ("comprl/MiniHack-Room-Ultimate-5x5-v0", "process", 2, {}),
    ("comprl/MiniHack-Room-5x5-v0", "thread", 2, {}),
    ("comprl/MiniHack-Room-5x5-v0", "process", 2, {}),
    ("comprl/Sokoban-6x6-2-v0", "thread", 2, {}),
]


def _pick(rng: random.Random, info: dict) -> str:
    actions = info.get("admissible_actions") or ["north"]
    return f"<answer>{rng.choice(actions)}</answer>"


def sequential_steps_per_s(env_id: str, steps: int, env_kwargs: dict) -> float:
    env = make(env_id, **env_kwargs)
    rng = random.Random(0)
    seed = 0
    _, info = env.reset(seed=seed)
    start = time.perf_counter()
    for _ in range(steps):
        _, _, term, trunc, step_info = env.step(_pick(rng, info))
        if term or trunc:
            seed += 1
            _, info = env.reset(seed=seed)
    return steps / (time.perf_counter() - start)


def pool_steps_per_s(
    env_id: str, backend: str, workers: int, slots: int, steps: int, env_kwargs: dict
) -> float:
    with EnvPool(
        env_id, num_slots=slots, num_workers=workers, backend=backend, env_kwargs=env_kwargs
    ) as pool:
        infos = [
            f.result()[1] for f in [pool.submit_reset(s, s) for s in range(slots)]
        ]  # warm-up: builds envs
        lock, finished = threading.Lock(), threading.Event()
        state = {"done": 0, "live": slots, "seed": slots}
        rngs = [random.Random(s) for s in range(slots)]

        def retire() -> None:
            state["live"] -= 1
            if state["live"] == 0:
                finished.set()

        def on_step(slot: int, fut) -> None:
            _, _, term, trunc, _ = fut.result()
            with lock:
                state["done"] += 1
                if state["done"] + state["live"] > steps:  # enough steps are in flight or done
                    retire()
                    return
                seed = None
                if term or trunc:
                    seed = state["seed"]
                    state["seed"] += 1
            if seed is None:
                pool.submit_step(slot, _pick(rngs[slot], infos[slot])).add_done_callback(
                    lambda f: on_step(slot, f)
                )
            else:
                pool.submit_reset(slot, seed).add_done_callback(lambda f: on_reset(slot, f))

        def on_reset(slot: int, fut) -> None:
            infos[slot] = fut.result()[1]
            pool.submit_step(slot, _pick(rngs[slot], infos[slot])).add_done_callback(
                lambda f: on_step(slot, f)
            )

        start = time.perf_counter()
        for s in range(slots):
            pool.submit_step(s, _pick(rngs[s], infos[s])).add_done_callback(lambda f, s=s: on_step(s, f))
        finished.wait()
        elapsed = time.perf_counter() - start
        return state["done"] / elapsed


def bench_env(
    env_id: str,
    backend: str,
    workers: int,
    steps: int,
    slots: int | None = None,
    env_kwargs: dict | None = None,
    repeats: int = 1,
) -> dict:
    """Measures one config and returns its JSON-able record (also what other env owners call)."""
    env_kwargs = env_kwargs or {}
    slots = slots or 4 * workers
    seqs, pars = [], []
    for _ in range(max(1, repeats)):  # interleaved, so load changes hit both sides alike
        seqs.append(sequential_steps_per_s(env_id, steps, env_kwargs))
        pars.append(pool_steps_per_s(env_id, backend, workers, slots, steps, env_kwargs))
    ratios = [p / q for p, q in zip(pars, seqs, strict=True)]
    return {
        "bench": "envs",
        "env": env_id,
        "backend": backend,
        "workers": workers,
        "slots": slots,
        "steps": steps,
        "repeats": len(seqs),
        "seq_steps_s": round(statistics.median(seqs), 1),
        "pool_steps_s": round(statistics.median(pars), 1),
        "ratio": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
    }


def gil_probe(env_id: str = "comprl/MiniHack-Room-5x5-v0", seconds: float = 1.0) -> list[dict]:
    """Does a call release the GIL? Its rate alone vs beside a pure-Python spinning thread, one record per call.

    A call that holds the GIL throughout shares it with the spinner: ``ratio`` ~0.5 (as pure Python does). A call
    that releases it while it works has to win the GIL back from the spinner after each release, waiting out
    the switch interval: ``ratio`` << 0.5 (``time.sleep(0)`` shows it). NLE's ``step`` lands at ~0.5, i.e. it
    runs under the GIL, so threads cannot run two NetHack steps at once.
    """
    env = make(env_id)
    env.reset(seed=0)
    nethack = env._nle.nethack._pynethack  # the C extension object itself, below every Python layer
    moves = [ord(c) for c in "hjkl"]

    def nle_step() -> None:
        if nethack.done():
            nethack.reset()
        nethack.step(moves[time.perf_counter_ns() % 4])

    def rate(fn, with_spinner: bool) -> float:
        stop = threading.Event()

        def spin() -> None:
            x = 0
            while not stop.is_set():
                x += 1

        spinner = threading.Thread(target=spin, daemon=True)
        if with_spinner:
            spinner.start()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            n += 1
        out = n / (time.perf_counter() - start)
        stop.set()
        if with_spinner:
            spinner.join()
        return out

    calls = [
        ("python (sum of a tuple)", lambda: sum((1, 2))),
        ("nle step (C)", nle_step),
        ("nle reset (C)", nethack.reset),
        ("time.sleep(0) (releases the GIL)", lambda: time.sleep(0)),
    ]
    records = []
    for name, fn in calls:
        alone, beside = rate(fn, False), rate(fn, True)
        records.append(
            {
                "bench": "envs_gil",
                "env": env_id,
                "call": name,
                "alone_per_s": round(alone, 1),
                "beside_spinner_per_s": round(beside, 1),
                "ratio": round(beside / alone, 3),
            }
        )
    env.close()
    return records


def _webshop_expert(env, seed: int, regex: re.Pattern) -> tuple[float, bool]:
    """The expert episode of goal ``seed``: search the goal text, page to the goal product (else search its title),
    click the goal's option values as the page shows them, buy. Returns (reward, whether every click it made is
    an action the constrained-decoding regex can write)."""
    env.reset(seed=seed)
    goal = env.goal
    asin = goal.asin.lower()
    clicks = []

    def act(action: str) -> dict:
        if action.startswith("click["):
            clicks.append(action)
        return env.step(f"<answer>{action}</answer>")

    info = act(f"search[{goal.instruction}]")[-1]
    while (
        f"click[{asin}]" not in info["admissible_actions"] and "click[next >]" in info["admissible_actions"]
    ):
        info = act("click[next >]")[-1]
    if f"click[{asin}]" not in info["admissible_actions"]:
        act("click[back to search]")
        act(f"search[{env.catalogue.product(asin)['Title']}]")
    act(f"click[{asin}]")
    for value in goal.options:
        act(f"click[{value}]")
    _, reward, terminated, _, _ = act("click[buy now]")
    assert terminated, goal.key
    in_regex = all(regex.fullmatch(f"<answer>{' '.join(c.lower().split())}</answer>") for c in clicks)
    return reward, in_regex


def webshop_figures(split: str = "eval") -> dict:
    """WebShop quality on a goal split: how often BM25 puts the goal product in the top 10 for the goal text, how
    often the expert episode (``_webshop_expert``) earns reward 1 and can be written under constrained decoding,
    and how often buying the goal product with one option swapped to another of its values still earns 1."""
    from comprl_jax.envs.webshop import reward
    from comprl_jax.envs.webshop.env import WebShopEnv

    env = WebShopEnv(split=split, max_turns=50)
    cat, goals = env.catalogue, env.goals
    top10 = sum(cat.asin_to_index[g.asin] in cat.engine.search(g.instruction)[:10] for g in goals)
    regex = re.compile(env.action_regex)
    experts = [_webshop_expert(env, seed, regex) for seed in range(len(goals))]
    wrong, wrong_full = 0, 0
    for goal in goals:
        product = cat.product(goal.asin)
        names = sorted(product["options"])
        for i, name in enumerate(names):
            for value in product["options"][name]:
                if value == goal.options[i]:
                    continue
                chosen = dict(zip(names, goal.options, strict=True)) | {name: value}
                wrong += 1
                wrong_full += reward.purchase_reward(product, goal, cat.prices[goal.asin], chosen)[0] >= 1.0
    return {
        "bench": "envs_webshop",
        "split": split,
        "goals": len(goals),
        "search_top10": round(top10 / len(goals), 3),
        "expert_purchase_rate": round(sum(r >= 1.0 for r, _ in experts) / len(goals), 3),
        "expert_clicks_in_regex": round(sum(ok for _, ok in experts) / len(goals), 3),
        "wrong_option_purchases": wrong,
        "wrong_option_rate": round(wrong_full / max(wrong, 1), 3),
    }


def swe_figures(limit: int = 0, task_file: str | None = None, stride: int = 1) -> dict:
    """SWE-Lite's checks of itself (issue 32 point 4) over every task of the file (``limit``: the first N): the
    reverse patch submitted solves, untouched code does not, the scripted grep-and-edit agent solves a fraction
    (``stride``: every stride-th task of each split, for a quicker sample);
    and hidden-test runs per second with 1 and 2 episodes evaluating at once (each run: a fresh bugged copy, the
    reverse patch, the task's tests in a fresh sandbox)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from comprl_jax.envs.swe import env as swe_env
    from comprl_jax.envs.swe.scripted import ScriptedAgent, call

    tasks = swe_env.load_tasks(task_file)
    ordered = [
        (split, i)
        for split in swe_env.SPLITS
        for i in range(0, len(swe_env.split_tasks(tasks, split)), stride)
    ]
    if limit:
        ordered = ordered[:limit]
    envs = {s: swe_env.SWELiteEnv(split=s, task_file=task_file) for s in swe_env.SPLITS}

    submit_s: list[float] = []

    def reverse_solves(env, i, timed: bool = False) -> bool:
        env.reset(seed=i)
        subprocess.run(
            ["patch", "-p1", "-R", "-s"], input=env.task["patch"], text=True, cwd=env.work, check=True
        )
        t0 = time.perf_counter()
        solved = env.step(call("submit"))[1] == 1.0
        if (
            timed
        ):  # the host's time of one submit step: walk, grading copy, the hidden tests in a fresh sandbox
            submit_s.append(time.perf_counter() - t0)
        return solved

    rev = noop = scripted = 0
    failures = []
    by_kind: dict[str, list[int]] = {}
    for split, i in ordered:
        env = envs[split]
        ok = reverse_solves(env, i, timed=True)
        rev += ok
        if not ok:
            failures.append(env.task["instance_id"])
        env.reset(seed=i)
        noop += env.step(call("submit"))[1] == 1.0
        _, info = env.reset(seed=i)

        def step(reply, env=env):
            o, r, term, trunc, _ = env.step(reply)
            return o, r, term or trunc

        won = ScriptedAgent().play(info["goal"], step) == 1.0
        scripted += won
        kind = by_kind.setdefault(env.task["kind"], [0, 0])
        kind[0] += won
        kind[1] += 1
    rates = {}
    sample = ordered[: min(len(ordered), 16)]
    for workers in (1, 2):
        # one shard of the sample per thread, each thread with its own envs (an env is one episode at a time)
        shards = [sample[w::workers] for w in range(workers)]
        own = [
            {sp: swe_env.SWELiteEnv(split=sp, task_file=task_file) for sp in swe_env.SPLITS} for _ in shards
        ]

        def run_shard(w, shards=shards, own=own):
            for sp, i in shards[w]:
                reverse_solves(own[w][sp], i)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as ex:
            list(ex.map(run_shard, range(workers)))
        rates[workers] = round(len(sample) / (time.perf_counter() - t0), 2)
        for d in own:
            for e in d.values():
                e.close()
    for e in envs.values():
        e.close()
    n = len(ordered)
    return {
        "bench": "envs",
        "env": "comprl/SWE-Lite-v0",
        "tasks": n,
        "reverse_patch_solved": round(rev / n, 4),
        "noop_solved": round(noop / n, 4),
        "scripted_solved": round(scripted / n, 4),
        "test_runs_s": {"1": rates[1], "2": rates[2]},
        "submit_s": {
            "mean": round(statistics.fmean(submit_s), 3),
            "p90": round(sorted(submit_s)[int(0.9 * (len(submit_s) - 1))], 3),
        },
        "scripted_by_kind": {k: f"{won}/{seen}" for k, (won, seen) in sorted(by_kind.items())},
        "reverse_patch_failures": failures[:20],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved seq / pool runs; medians reported"
    )
    parser.add_argument("--only", default="", help="substring filter on env ids")
    parser.add_argument("--backend", default="", help="only this backend (thread / process)")
    parser.add_argument("--gil", action="store_true", help="only the GIL probe of NLE's step / reset")
    parser.add_argument("--webshop", action="store_true", help="only the WebShop quality figures")
    parser.add_argument("--split", default="eval", help="WebShop goal split for --webshop")
    parser.add_argument("--swe", action="store_true", help="only SWE-Lite's checks of itself")
    parser.add_argument("--swe_tasks", type=int, default=0, help="--swe: the first N tasks (0 = all)")
    parser.add_argument("--swe_file", default=None, help="--swe: a task file (default: the shipped one)")
    parser.add_argument("--swe_stride", type=int, default=1, help="--swe: every N-th task of each split")
    args = parser.parse_args()
    if args.swe:
        print(json.dumps(swe_figures(args.swe_tasks, args.swe_file, args.swe_stride)), flush=True)
        return
    if args.webshop:
        print(json.dumps(webshop_figures(args.split)), flush=True)
        return
    if args.gil:
        for rec in gil_probe():
            print(json.dumps(rec), flush=True)
        return
    for env_id, backend, workers, kwargs in CONFIGS:
        if args.only in env_id and args.backend in ("", backend):
            rec = bench_env(env_id, backend, workers, args.steps, env_kwargs=kwargs, repeats=args.repeats)
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
