"""The async env pool: identical group starts, fault survival (raise / hang) over 500 episodes, clean shutdown."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from comprl_jax.envs.base import TextEnv
from comprl_jax.envs.pool import EnvPool

# Test-only env, reachable by entry point (also from spawned worker processes, which import this module).
FLAKY = f"{__name__}:FlakyEnv"
EPISODE_LEN = 4


class FlakyEnv(TextEnv):
    """Cheap env: an episode is EPISODE_LEN steps and succeeds at the end, but ``step`` raises with probability
    ``p_raise`` and hangs for ``hang_s`` on the first step of episodes whose seed is in ``hang_seeds``."""

    def __init__(
        self, p_raise: float = 0.1, hang_seeds: tuple = (), hang_s: float = 30.0, max_turns: int = 10
    ):
        super().__init__(max_turns)
        self.p_raise, self.hang_seeds, self.hang_s = p_raise, set(hang_seeds), hang_s
        self.rng = random.Random(0)
        self.seed = None

    def _reset(self, seed):
        self.seed, self.pos = seed, 0
        self.rng = random.Random(seed)
        return f"start {seed}", {"task_id": "flaky", "goal": "walk", "query": f"start {seed}"}

    def _step(self, action):
        if self.pos == 0 and self.seed in self.hang_seeds:
            time.sleep(self.hang_s)
        if self.rng.random() < self.p_raise:
            raise RuntimeError(f"flaky failure at seed {self.seed} pos {self.pos}")
        self.pos += 1
        done = self.pos >= EPISODE_LEN
        return f"pos {self.pos}", float(done), done, {"success": done, "invalid_action": action is None}

    def system_prompt(self):
        return "walk"


def run_episodes(pool: EnvPool, num_episodes: int) -> list[dict]:
    """Drives every slot through episodes until num_episodes have finished; returns one record per episode."""
    records, next_seed = [], 0
    active = {}
    for slot in range(pool.num_slots):
        active[slot] = pool.submit_reset(slot, next_seed), next_seed, "reset"
        next_seed += 1
    while active:
        for slot, (fut, seed, kind) in list(active.items()):
            if not fut.done():
                continue
            result = fut.result()
            info = result[-1]
            ended = kind == "reset" and info.get("failed") or kind == "step" and (result[2] or result[3])
            if ended:
                records.append(
                    {"seed": seed, "success": bool(info.get("success")), "error": info.get("error")}
                )
                if next_seed < num_episodes:
                    active[slot] = pool.submit_reset(slot, next_seed), next_seed, "reset"
                    next_seed += 1
                else:
                    del active[slot]
            else:
                active[slot] = pool.submit_step(slot, "<answer>go</answer>"), seed, "step"
        time.sleep(0.0005)
    return records


def children():
    """Our child processes, minus multiprocessing's resource tracker (one per interpreter, started on the first
    spawn and kept for its lifetime by design; it is not a pool worker)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def check_accounting(records, num_episodes, hang_seeds, pool):
    assert sorted(r["seed"] for r in records) == list(range(num_episodes)), (
        "every episode accounted for, once"
    )
    errors = [r for r in records if r["error"]]
    raised = [r for r in errors if "flaky failure" in r["error"]]
    hung = [r for r in errors if "timed out" in r["error"]]
    # Process backend: killing a hung worker also ends the episodes of its other slots (reported as lost).
    lost = [r for r in errors if "no live env" in r["error"]]
    assert len(raised) + len(hung) + len(lost) == len(errors)
    assert {r["seed"] for r in hung} == set(hang_seeds)
    per_worker = pool.num_slots // pool.num_workers
    assert len(lost) <= (per_worker - 1) * len(hang_seeds) if pool.backend == "process" else not lost
    assert all(not r["success"] for r in errors)
    assert all(r["success"] for r in records if not r["error"])
    # P(episode hits a raise) = 1 - 0.9^4 ~ 0.34 -> ~171 of 500; a loose band around it.
    assert 100 < len(raised) < 250, len(raised)
    stats = pool.stats()
    assert stats["timeouts"] == len(hang_seeds) and stats["restarts"] >= len(hang_seeds)
    print(
        f"{pool.backend}: {len(records)} episodes, {len(raised)} raised, {len(hung)} hung, {len(lost)} lost; {stats}"
    )


def test_thread_pool_survives_raise_and_hang_over_500_episodes():
    hang_seeds = (7, 250)
    kwargs = {"p_raise": 0.1, "hang_seeds": list(hang_seeds), "hang_s": 2.0}
    with EnvPool(
        FLAKY, num_slots=8, num_workers=2, backend="thread", env_kwargs=kwargs, timeout_s=0.5
    ) as pool:
        records = run_episodes(pool, 500)
        check_accounting(records, 500, hang_seeds, pool)


@pytest.mark.slow
def test_process_pool_survives_raise_and_hang_over_500_episodes():
    before = children()
    hang_seeds = (7, 250)
    kwargs = {"p_raise": 0.1, "hang_seeds": list(hang_seeds), "hang_s": 600.0}
    with EnvPool(
        FLAKY, num_slots=8, num_workers=2, backend="process", env_kwargs=kwargs, timeout_s=1.0
    ) as pool:
        records = run_episodes(pool, 500)
        check_accounting(records, 500, hang_seeds, pool)
        assert len(children() - before) >= 2
    time.sleep(0.2)
    assert children() == before, "worker processes leaked"


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_group_members_start_identical_through_pool(backend):
    """K = 4 slots reset with one seed start identical and stay identical under the same actions (MiniHack)."""
    with EnvPool("comprl/MiniHack-Room-Ultimate-5x5-v0", num_slots=5, num_workers=2, backend=backend) as pool:
        starts = [f.result() for f in pool.reset_group(range(4), seed=31)]
        other = pool.submit_reset(4, seed=32).result()
        assert len({obs for obs, _ in starts}) == 1 and starts[0][1]["seed"] == 31
        assert other[0] != starts[0][0]
        for move in ["east", "south", "southeast", "west", "north"]:
            steps = [f.result() for f in [pool.submit_step(s, f"<answer>{move}</answer>") for s in range(4)]]
            assert len({r[0] for r in steps}) == 1
            assert isinstance(steps[0][4], dict) and isinstance(steps[0][1], float)


def test_bad_arguments_are_named():
    with pytest.raises(KeyError, match="comprl/Nope-v0"):
        EnvPool("comprl/Nope-v0", num_slots=1)
    with pytest.raises(TypeError, match="env_kwargs\\['hang_seeds'\\]"):
        EnvPool(FLAKY, num_slots=1, env_kwargs={"hang_seeds": {1, 2}})
    with EnvPool(FLAKY, num_slots=2, num_workers=1) as pool:
        with pytest.raises(IndexError, match="slot 2"):
            pool.submit_step(2, "x")
        obs, _, term, _, info = pool.submit_step(0, "x").result()  # step before any reset
        assert term and info["failed"] and "reset" in info["error"]
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit_reset(0, 1)


@pytest.mark.slow
def test_keyboard_interrupt_leaves_no_orphans(tmp_path):
    """A driver process using a process pool gets SIGINT mid-run: it exits, and its workers are gone."""
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            from comprl_jax.envs.pool import EnvPool
            with EnvPool({FLAKY!r}, num_slots=2, num_workers=2, backend="process",
                         env_kwargs={{"p_raise": 0.0}}) as pool:
                pool.submit_reset(0, 1).result(); pool.submit_reset(1, 2).result()
                print("READY", flush=True)
                while True:
                    pool.submit_step(0, "<answer>go</answer>").result()
                    pool.submit_reset(0, 1).result()
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        workers = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(workers) >= 2
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        assert proc.returncode != 0  # the KeyboardInterrupt propagated after the pool closed
        gone, alive = psutil.wait_procs(
            [psutil.Process(p) for p in workers if psutil.pid_exists(p)], timeout=10
        )
        assert not alive, f"orphan workers: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
