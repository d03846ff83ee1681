"""Device placement (issue 8): actor and extractor on disjoint sub-meshes vs co-located.

On 8 fake CPU devices, ``mesh.placement=disjoint`` puts the actor on 4 devices and the extractor on the other 4.
The extractor's CISPO update is dispatched asynchronously at the end of a step and joined after the next step's
rollout, so the two overlap in wall time (``timeline.jsonl``). The reference is a co-located run with both roles
on the same 4 devices (the same per-role mesh shape, so the same compiled programs): parameters, bank, extractor
buffer and metrics must be bit-identical.
"""

import json
import os
import subprocess
import sys

import pytest
from trainer_helpers import REPO, cache_env, flags

# A mesh of (data 2, tensor 2) per role; batches sized so that both roles train on non-zero advantages and the
# extractor's buffer fills by step 1 (its first update compiles in the dispatch; step 2's, already compiled, then
# overlaps step 3's rollout).
OVER = {
    "mesh.data": 2,
    "mesh.tensor": 2,
    "rollout.tasks_per_step": 2,
    "rollout.group_size": 4,
    "actor.micro_batch": 4,
    "extractor.micro_batch": 2,
    "retrieval.k": 2,
    "bank.merge_every": 2,
    "env.max_turns": 8,
    # 4 steps run (--stop_after=4) of 5: the run stops with its checkpoint, store and digests but skips the
    # end-of-run evaluation, which this test does not read (it compiled new sampler programs in each run)
    "train.steps": 5,
    "checkpoint.every": 10,  # a checkpoint joins the update in flight; keep them out of the way
    # auto would pick "rollout" for the disjoint run and "update" for the co-located one; the co-located run takes
    # the disjoint run's schedule, so that only the placement differs
    "extractor.distill_overlap": "rollout",
    # Search & ask on (the default): the disjoint run's extractor sampler answers during the next rollout while the
    # update runs, with the weights from before it, as the co-located run's does (trainer.join_extractor).
}


def _env(cache_dir, devices=8):
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "TOKENIZERS_PARALLELISM": "false",
        # Both runs compile the same programs: the second one reads them from this cache.
        **cache_env(cache_dir),
    }


def _run(workdir, cache_dir, **over):
    cmd = [
        sys.executable,
        "launch/train.py",
        "--config=configs/minihack_room.py:tiny",
        f"--workdir={workdir}",
        "--stop_after=4",
    ]
    cmd += flags(**{**OVER, **over})
    r = subprocess.run(cmd, cwd=REPO, env=_env(cache_dir), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _strip_times(rows):
    return [
        {k: v for k, v in r.items() if not (k.startswith("time") or "_s" in k or "ms" in k)} for r in rows
    ]


def _store(workdir, step):
    d = os.path.join(workdir, "experience", str(step))
    out = {}
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            out[name] = f.read()
    return out


def test_role_devices_split_and_errors():
    """Colocated: both roles on every device; disjoint: the actor's share first on each process, the rest to the
    extractor; errors name the config key."""
    import jax
    import ml_collections

    from comprl_jax.runtime import distributed as dist

    def cfg(**kw):
        base = dict(
            data=-1,
            fsdp=1,
            tensor=1,
            extractor_tensor=0,
            placement="colocated",
            actor_fraction=0.5,
            num_devices=0,
        )
        return ml_collections.ConfigDict({**base, **kw})

    devs = jax.devices()
    a, x = dist.role_devices(cfg())
    assert a == x == devs
    a, x = dist.role_devices(cfg(placement="disjoint"))
    assert a == devs[:4] and x == devs[4:]
    a, x = dist.role_devices(cfg(placement="disjoint", actor_fraction=0.75, num_devices=4))
    assert a == devs[:3] and x == devs[3:4]
    assert dist.role_devices(cfg(num_devices=1)) is None  # one device: the unsharded path
    am, xm = dist.build_meshes(cfg(placement="disjoint", fsdp=2))
    assert dict(am.shape) == dict(xm.shape) == {"data": 2, "fsdp": 2, "tensor": 1}
    assert set(am.devices.flat).isdisjoint(xm.devices.flat)
    with pytest.raises(ValueError, match="mesh.actor_fraction"):
        dist.role_devices(cfg(placement="disjoint", actor_fraction=0.1, num_devices=4))
    with pytest.raises(ValueError, match="mesh.num_devices"):
        dist.role_devices(cfg(num_devices=16))
    with pytest.raises(ValueError, match="mesh.data/fsdp/tensor"):
        dist.build_meshes(cfg(placement="disjoint", fsdp=3))
    # the extractor's own tensor split (80 GB GPUs, WORKSPACE "Memory plans"): same devices, another mesh
    am, xm = dist.build_meshes(cfg(data=1, fsdp=-1, extractor_tensor=2))
    assert dict(am.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert dict(xm.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert set(am.devices.flat) == set(xm.devices.flat) == set(devs)
    am, xm = dist.build_meshes(cfg(extractor_tensor=1))
    assert am is xm  # nothing differs: one mesh
    with pytest.raises(ValueError, match="mesh.data/fsdp/tensor/extractor_tensor"):
        dist.build_meshes(cfg(placement="disjoint", extractor_tensor=3))


@pytest.mark.slow
def test_disjoint_overlaps_and_equals_colocated(tmp_path):
    cache = tmp_path / "xla_cache"
    dis, col = tmp_path / "disjoint", tmp_path / "colocated"
    _run(dis, cache, **{"mesh.placement": "disjoint", "mesh.num_devices": 8})
    _run(col, cache, **{"mesh.placement": "colocated", "mesh.num_devices": 4})

    # Overlap: an extractor update (dispatch -> device done) spans the start of the next step's rollout.
    events = _jsonl(dis / "timeline.jsonl")
    updates = [e for e in events if e["event"] == "extractor_update"]
    rollouts = {e["step"]: e for e in events if e["event"] == "actor_rollout"}
    overlapped = [
        (u, rollouts[u["step"] + 1])
        for u in updates
        if u["step"] + 1 in rollouts
        and u["start"] < rollouts[u["step"] + 1]["end"]
        and rollouts[u["step"] + 1]["start"] < u["end"]
    ]
    assert overlapped, events
    # Co-located: the update finishes inside its own step, before the next rollout starts.
    cevents = _jsonl(col / "timeline.jsonl")
    crollouts = {e["step"]: e for e in cevents if e["event"] == "actor_rollout"}
    for u in (e for e in cevents if e["event"] == "extractor_update"):
        if u["step"] + 1 in crollouts:
            assert u["end"] <= crollouts[u["step"] + 1]["start"]

    # Same results: parameters (actor, extractor), replicated host state, bank store, metrics.
    with open(dis / "digest_p0.json") as f1, open(col / "digest_p0.json") as f2:
        d1, d2 = json.load(f1), json.load(f2)
    assert d1 == d2
    rows = _jsonl(dis / "metrics.jsonl")
    assert _strip_times(rows) == _strip_times(_jsonl(col / "metrics.jsonl"))
    assert _store(dis, 4) == _store(col, 4)
    # Non-trivial: both roles took gradient steps with non-zero gradients.
    assert any(r.get("actor/grad_norm", 0) > 0 for r in rows)
    assert any(r.get("extractor/grad_norm", 0) > 0 for r in rows)
