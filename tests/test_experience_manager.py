"""ExperienceManager under concurrency, and save -> new process -> restore equality."""

import dataclasses
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import pytest
from test_experience_helpers import DIM, FakeClock, add, answer, hash_embed, mem, update

from comprl_jax.experience import (
    BankConfig,
    BufferConfig,
    DistillRequest,
    ExperienceManager,
    IndexConfig,
    RetrievalConfig,
)
from launch.threaded_manager import ThreadedExperienceManager

WORDS = ["key", "door", "stairs", "east", "west", "box", "lava", "shop", "red", "blue", "apple", "fridge"]


def _lesson(rng):
    return mem(rng.choice(WORDS), " ".join(rng.choice(WORDS) for _ in range(4)))


class Extractor:
    """Plain-callable extractor: random add/update/return/garbage outputs; tallies the op items it emits."""

    def __init__(self, seed):
        self.rng, self.items, self.lock = random.Random(seed), 0, threading.Lock()

    def __call__(self, prompts):
        out = []
        with self.lock:
            for p in prompts:
                ops = [
                    self.rng.choice(
                        [
                            add(_lesson(self.rng)),
                            update([self.rng.randint(1, 6)], _lesson(self.rng)),
                            {"function_name": "return"},
                        ]
                    )
                    for _ in range(self.rng.randint(1, 3))
                ]
                if "Merge the lessons" in p:
                    ops = (
                        [add(_lesson(self.rng))] if self.rng.random() < 0.7 else [{"function_name": "return"}]
                    )
                    out.append(answer(*ops))
                    continue
                if self.rng.random() < 0.1:
                    out.append("garbage")
                    self.items += 1
                else:
                    out.append(answer(*ops))
                    self.items += len(ops)
        return out


def test_concurrent_readers_writers_and_merges():
    ext = Extractor(0)
    m = ThreadedExperienceManager(
        hash_embed,
        DIM,
        ext,
        bank_cfg=BankConfig(
            capacity=400, index=IndexConfig(scann_min_size=150, rebuild_fraction=0.2, background=True)
        ),
        buffer_cfg=BufferConfig(batch_size=16),
        retrieval_cfg=RetrievalConfig(k=2),
    )
    stop = threading.Event()
    errors, submitted, searches = [], [0] * 8, [0] * 8

    def writer(i):
        rng = random.Random(100 + i)
        try:
            while not stop.is_set():
                task = rng.choice("ab")
                r = rng.random()
                if r < 0.45:
                    shown = m.previous_lessons(task, rng.choice(WORDS))
                    ops = [add(_lesson(rng)) for _ in range(rng.randint(1, 3))] + [
                        update([rng.randint(1, 6)], _lesson(rng))
                    ]
                    m.apply_output(task, answer(*ops), shown, step=0, prompt="p")
                    submitted[i] += len(ops)
                elif r < 0.75:
                    m.submit_distill(
                        DistillRequest(task, "goal", rng.random() < 0.5, "traj", rng.choice(WORDS))
                    )
                else:
                    hit = m.search([rng.choice(WORDS)], [task])[0]
                    m.record_outcome(hit.uids, rng.random() < 0.5)
                    b = m.pop_extractor_batch(step=rng.randint(0, 5))
                    if b is not None:
                        m.mark_trained(b, b.step)
        except Exception:  # noqa: BLE001
            errors.append(traceback.format_exc())

    def reader(i):
        rng = random.Random(200 + i)
        try:
            while not stop.is_set():
                qs = [" ".join(rng.choice(WORDS) for _ in range(2)) for _ in range(rng.randint(1, 4))]
                ts = [rng.choice("ab") for _ in qs]
                for t, r in zip(ts, m.search(qs, ts), strict=True):
                    assert len(r.uids) <= 2
                    with m.lock.read():
                        assert all(m.bank.entries[u].task_id == t for u in r.uids if u in m.bank.entries)
                searches[i] += len(qs)
        except Exception:  # noqa: BLE001
            errors.append(traceback.format_exc())

    def merger():
        step = 0
        while not stop.wait(1.5):
            step += 5
            try:
                m.merge(step)
            except Exception:  # noqa: BLE001
                errors.append(traceback.format_exc())

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=reader, args=(i,)) for i in range(8)] + [
        threading.Thread(target=merger)
    ]
    for t in threads:
        t.start()
    time.sleep(10)
    stop.set()
    for t in threads:
        t.join()
    m.drain(timeout=60)
    m.close()
    assert errors == [] and m.errors == []
    m.bank.wait_for_builds()
    m.check_invariants()
    c = m.counts
    assert c["ops_submitted"] == sum(submitted) + ext.items
    assert c["ops_submitted"] == c["ops_applied"] + c["ops_returned"] + c["ops_rejected"]
    assert c["merge_chunks"] > 0 and sum(searches) > 100 and c["ops_applied"] > 100
    assert sum(ix.num_builds for ix in m.bank.indexes.values()) > 0  # ScaNN was rebuilt in the background


# -- persistence ----------------------------------------------------------------------------------
QUERIES = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3)) for i in range(40)]


def _make(clock):
    return ExperienceManager(
        hash_embed,
        DIM,
        None,
        clock=clock,
        bank_cfg=BankConfig(index=IndexConfig(scann_min_size=300, background=False)),
        buffer_cfg=BufferConfig(batch_size=8),
        retrieval_cfg=RetrievalConfig(k=2),
    )


def _state(m):
    entries = [{k: v for k, v in vars(e).items()} for e in m.bank.entries.values()]
    return {
        "entries": entries,
        "buffer": m.buffer.state_dict(),
        "counts": dict(m.counts),
        "next_uid": m.bank.next_uid,
        "op_log_len": len(m.bank.op_log),
        "vectors": np.stack([m.bank.vector(u) for u in m.bank.entries]).round(6).tolist(),
    }


def _answers(m, clock):
    out = []
    for i in range(0, len(QUERIES), 8):
        clock.t += 50.0
        out += [r.uids for r in m.search_sync(QUERIES[i : i + 8], ["a" if i % 16 else "b"] * 8)]
    return out


def restore_and_answer(path, t):  # runs in the child process
    clock = FakeClock(t)
    m = ExperienceManager.restore(path, hash_embed, clock=clock)
    state = _state(m)
    print(json.dumps({"state": state, "answers": _answers(m, clock)}))


def test_save_restore_in_new_process_answers_identically(tmp_path):
    clock = FakeClock()
    m = _make(clock)
    rng = random.Random(0)
    for i in range(500):
        task = "a" if i % 5 else "b"
        m.apply_output(task, answer(add(_lesson(rng))), [], step=i, prompt=f"p{i}")
    m.apply_output("a", answer(update([1, 2], _lesson(rng))), m.bank.partition("a")[:2], step=9)
    assert m.bank.indexes["a"].built is not None  # the restore must reload the ScaNN searcher, not rebuild it
    for i in range(30):
        hit = m.search_sync([QUERIES[i]], ["a"])[0]
        m.record_outcome(hit.uids, i % 3 == 0)
        clock.t += 7.0
    b = m.pop_extractor_batch(step=1)
    m.mark_trained(b, 1)
    path = str(tmp_path / "store")
    m.save(path)
    m.save(path)  # overwriting an existing store is atomic too
    assert sorted(os.listdir(tmp_path)) == ["store"]
    live_state = json.loads(json.dumps(_state(m)))
    live = _answers(m, clock)
    code = (
        "import sys; sys.path.insert(0, 'tests'); import test_experience_manager as t; "
        f"t.restore_and_answer({path!r}, {FakeClock().t + 210.0!r})"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(__file__)),
        check=True,
    )
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["state"] == live_state
    assert child["answers"] == live


def test_load_rejects_mismatched_config_and_restore_takes_saved_ones(tmp_path):
    m = _make(FakeClock())
    m.apply_output("a", answer(add(mem("k", "v"))), [], step=0)
    m.save(str(tmp_path / "s"))
    other = ExperienceManager(
        hash_embed,
        DIM,
        bank_cfg=m.bank.cfg,
        buffer_cfg=m.buffer.cfg,
        retrieval_cfg=RetrievalConfig(k=3),
    )
    with pytest.raises(ValueError, match=r"retrieval config differs .*\['k'\]"):
        other.load(str(tmp_path / "s"))
    r = ExperienceManager.restore(str(tmp_path / "s"), hash_embed)
    assert r.retrieval_cfg.k == 2 and r.bank.cfg.index.scann_min_size == 300 and len(r.bank.entries) == 1
    with pytest.raises(FileNotFoundError, match="missing meta.json"):
        r.load(str(tmp_path / "nope"))
    # what schedules the run (merges, search & ask) may change on a resume: the store means the same
    sched = ExperienceManager(
        hash_embed,
        DIM,
        bank_cfg=dataclasses.replace(m.bank.cfg, merge_every=9, merge_chunk=2),
        buffer_cfg=m.buffer.cfg,
        retrieval_cfg=dataclasses.replace(m.retrieval_cfg, search_and_ask_max=0, embedder="other"),
    )
    sched.load(str(tmp_path / "s"))
    assert len(sched.bank.entries) == 1


def test_a_store_saved_before_the_config_renames_loads(tmp_path):
    """Issue 29 renamed fields (RetrievalConfig top_k -> k, num_candidates -> candidates; ManagerConfig batch ->
    query_batch, workers -> search_workers, merge_chunk -> BankConfig); a store written before reads as today's."""
    import json

    m = _make(FakeClock())
    m.apply_output("a", answer(add(mem("k", "v"))), [], step=0)
    path = tmp_path / "s"
    m.save(str(path))
    meta = json.loads((path / "meta.json").read_text())
    c = meta["configs"]
    r = c["retrieval"]
    r["top_k"], r["num_candidates"], r["window"] = r.pop("k"), r.pop("candidates"), r.pop("window_s")
    for k in (
        "clock",
        "window_steps",
        "embedder",
        "search_and_ask",
        "search_and_ask_max",
        "search_and_ask_guided_only",
    ):
        r.pop(k)
    c["manager"]["batch"], c["manager"]["workers"] = (
        c["manager"].pop("query_batch"),
        c["manager"].pop("search_workers"),
    )
    c["manager"]["merge_chunk"] = c["bank"].pop("merge_chunk")
    c["bank"]["dedup_threshold"] = None
    (path / "meta.json").write_text(json.dumps(meta))
    m.load(str(path))  # the same manager: the old names compare equal to today's fields
    back = ExperienceManager.restore(str(path), hash_embed)
    assert back.retrieval_cfg.k == m.retrieval_cfg.k and back.cfg.query_batch == m.cfg.query_batch
    assert back.bank.cfg.merge_chunk == m.bank.cfg.merge_chunk and back.bank.cfg.dedup_threshold == 0.0
    assert back.retrieval_cfg.window == m.retrieval_cfg.window == 300.0  # the old window, as a wall window
    # the window is compared as Eq. 6 uses it: a step-clock manager with that window loads, another does not
    steps = dataclasses.replace(m.retrieval_cfg, clock="step", window_steps=300, window_s=1.0)
    ExperienceManager(
        hash_embed, DIM, bank_cfg=m.bank.cfg, buffer_cfg=m.buffer.cfg, retrieval_cfg=steps
    ).load(str(path))
    other = dataclasses.replace(steps, window_steps=2)
    with pytest.raises(ValueError, match=r"retrieval config differs .*\['window'\]"):
        ExperienceManager(
            hash_embed, DIM, bank_cfg=m.bank.cfg, buffer_cfg=m.buffer.cfg, retrieval_cfg=other
        ).load(str(path))


def test_distill_queue_and_search_and_ask_rewards():
    prompts = []

    def extractor(ps):
        prompts.extend(ps)
        return [
            answer(update([1], mem("door", "open the door first")))
            if "Goal" in p
            else "<think>hm</think><answer>Open the red door, then go east.</answer>"
            for p in ps
        ]

    with ThreadedExperienceManager(
        hash_embed,
        DIM,
        extractor,
        clock=FakeClock(),
        buffer_cfg=BufferConfig(batch_size=2),
        bank_cfg=BankConfig(index=IndexConfig(scann_min_size=10**9)),
    ) as m:
        m.apply_output(
            "t",
            answer(add(mem("door", "doors are locked")), add(mem("lava", "avoid lava"))),
            [],
            step=0,
            prompt="seed",
        )
        m.submit_distill(
            DistillRequest(
                "t", "reach the stairs", False, "obs: door\nact: east", "door lava", retrieved=[1], step=3
            )
        )
        m.drain(timeout=30)
        # The episode's retrieved entry (uid 1) is shown first, so target 1 replaced "avoid lava".
        assert "Outcome: FAILURE" in prompts[0] and prompts[0].index("avoid lava") < prompts[0].index(
            "locked"
        )
        assert [e.text for e in m.bank.entries.values()] == [
            mem("door", "doors are locked"),
            mem("door", "open the door first"),
        ]
        assert m.bank.entries[2].prompt == prompts[0] and m.bank.entries[2].created_step == 3
        text, key, uids = m.refine("how do I open it?", "a locked door", "t")
        assert text == "Open the red door, then go east." and key == "refine:0" and len(uids) == 1
        m.record_refine_outcome(key, True)
        m.record_outcome(uids, False)
        b = m.pop_extractor_batch(step=4)
        call = m.bank.entries[uids[0]].call
        assert b.keys == ["refine:0", f"call:{call}"] and b.rewards.tolist() == [1.0, -1.0]
        assert b.prompts[0] == prompts[1]
        m.check_invariants()
