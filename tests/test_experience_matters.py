"""Issue 31: each side of the loop with the other side scripted, on HiddenRule (launch/bench/experience_matters.py).

Fast tests check the two scripted stand-ins themselves against the real parser, bank format and env pools: the
oracle extractor writes exactly the family's rule after a success and nothing otherwise; the scripted reader follows
the action a lesson names and is uniform without one. The slow tests run each side (WORKSPACE "HiddenRule").
"""

import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest
from trainer_helpers import REPO

from comprl_jax.envs import hidden_rule as hr
from comprl_jax.experience.ops import distill_prompt, merge_prompt, parse_ops
from comprl_jax.experience.retrieval import format_experience
from comprl_jax.rollout.engine import Rollout
from comprl_jax.rollout.episodes import EpisodeSpec
from comprl_jax.rollout.pools import Pools, reset_all
from comprl_jax.rollout.tasks import Task

ENV = "comprl/HiddenRule-v0"


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_experience_matters", os.path.join(REPO, "launch/bench/experience_matters.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_oracle_writes_the_family_rule_after_a_success_and_nothing_else():
    em = _bench()
    rules = hr.rules(4)
    oracle = em.OracleExtractor(rules)
    family = "green chest"
    goal = f"Open the {family} in the cellar."
    win = distill_prompt(goal, True, "Observation: ...\nAction: <answer>kick</answer>", [], 200)
    loss = distill_prompt(goal, False, "Observation: ...\nAction: <answer>kick</answer>", [], 200)
    merge = merge_prompt(["<title>a</title><content>b</content>"], 200)
    out = oracle([win, loss, merge])
    (op,) = parse_ops(out[0], 0, 200).ops
    assert op.function == "add" and op.new_memory == (
        f"<title>{family}</title><content>to open a {family}, {rules[family][0]}</content>"
    )
    for text in out[1:]:
        got = parse_ops(text, 0, 200)
        assert not got.ops and got.num_returns == 1
    assert oracle.written == 1
    # the block the actor sees names exactly that action, once
    block = format_experience([op.new_memory])
    assert em.named_actions(em.block_lessons(block)) == [rules[family][0]]
    assert em.lesson_texts(out[0]) == [f"{family}: to open a {family}, {rules[family][0]}"]


def test_named_actions_reads_tokens_glued_to_their_neighbours_in_order():
    em = _bench()
    assert em.named_actions("themknock would pushx, then pull") == ["knock", "push", "pull"]
    assert em.named_actions("nothing here") == []


def _reader_rollout(em, blocks, run_seed=3, task_seed=17):
    """One task, one episode per experience block, played by the scripted reader on the real env pool."""
    pools = Pools([ENV], len(blocks), 1, "thread", 4, 30.0, run_seed=run_seed)
    try:
        task = Task(ENV, task_seed, 0)
        specs = [EpisodeSpec(task, i, bool(b), experience=b) for i, b in enumerate(blocks)]
        resets = reset_all(pools, specs)
        r = Rollout(pools, sampler=None, tokenizer=_Tok(), sp=None, max_turns=4, max_len=2048)
        trajs, _ = em.ScriptedReader(seed=0).play(r, specs, resets, key=None)
        return trajs, resets[0][1]["family"]
    finally:
        pools.close()


class _Tok:
    """The reader tokenises nothing it uses; start_episodes needs a chat template."""

    special_ids: dict = {}

    def apply_chat_template(self, msgs, add_generation_prompt=True):
        return [[0]]


def test_scripted_reader_follows_the_named_action_and_is_uniform_without_one():
    em = _bench()
    rules = hr.rules(3)
    family = hr.instance(17)[0]
    right = rules[family][0]
    wrong = next(a for a in hr.ACTIONS if a != right)
    lesson = lambda act: format_experience([f"<title>{family}</title><content>to open it, {act}</content>"])  # noqa: E731
    trajs, fam = _reader_rollout(em, [lesson(right)] * 8 + [lesson(wrong)] * 8)
    assert fam == family
    assert all(t.success for t in trajs[:8]) and not any(t.success for t in trajs[8:])
    assert all(t.transcript[0][1] == f"<answer>{wrong}</answer>" for t in trajs[8:])
    # no lesson (free episodes) or a lesson that names no action: uniform, success 1/8
    n = 400
    trajs, _ = _reader_rollout(em, [""] * (n // 2) + [format_experience([])] * (n // 2))
    wins = sum(t.success for t in trajs)
    played = {t.transcript[0][1] for t in trajs}
    assert played == {f"<answer>{a}</answer>" for a in hr.ACTIONS}
    assert abs(wins / n - 0.125) < 4 * math.sqrt(0.125 * 0.875 / n)
    assert np.isclose(hr.success_rates()["uniform_random"], 0.125)


def test_a_lesson_written_after_one_success_reaches_its_family_and_changes_what_is_played(tmp_path):
    """Both sides scripted, the rest real (bank, MiniLM embedder, Eq. 6 retrieval, system prompt, subgroup
    bookkeeping): the oracle writes a family's rule after a success, the reader plays what a retrieved lesson names.
    Guided episodes must then beat free ones by far more than noise, and exactly through lessons of their own
    family: every guided episode that found one succeeded (a lesson of another family helps only where the two rules
    coincide, so guided success is at least the hit rate). This is what
    would notice retrieved lessons that never reach the prompt, or reach another family's episodes."""
    em = _bench()
    out = em.run("both", 0, 8, str(tmp_path / "both"), log=lambda line: None)
    rows, summary = out["rows"], out["summary"]
    late = rows[4:]
    guided = np.mean([r["guided"] for r in late])
    free = np.mean([r["free"] for r in late])
    n = 32 * len(late)  # guided (and free) episodes in the second half: 8 tasks x 4
    se = math.sqrt(0.125 * 0.875 / n) * math.sqrt(2)
    assert guided - free > 6 * se, (guided, free, se)  # measured 2026-12-05: 0.55 vs 0.14 over steps 3-5
    for r in late:
        assert r["guided_hit"] == 1.0 and r["guided"] >= r["hit"] - 1e-9
    assert summary["hit_second_half"] > summary["hit_first_half"]  # the bank covers more families as it grows
    assert abs(summary["free_second_half"] - 0.125) < 4 * math.sqrt(0.125 * 0.875 / n)


def test_lesson_audit_reads_the_op_log_of_a_finished_run(tmp_path):
    em = _bench()
    seed = 5
    rules = hr.rules(seed)
    fam, other = hr.FAMILIES[0], hr.FAMILIES[7]
    right, wrong = rules[fam][0], next(a for a in hr.ACTIONS if a != rules[fam][0])
    run = tmp_path / "complementary_s5"
    (run / "experience" / "4").mkdir(parents=True)
    (run / "experience" / "2").mkdir(parents=True)  # an older save: not read
    cfg = {"seed": seed, "method": "complementary", "env": {"tasks": [ENV]}, "train": {"steps": 4}}
    (run / "config.json").write_text(json.dumps(cfg))

    def add(step, family, success, text, kind="distill"):
        prompt = distill_prompt(
            f"Open the {family} in the attic.", success, "Action: <answer>x</answer>", [], 200
        )
        return {"op": "add", "uid": 0, "text": text, "step": step, "prompt": prompt, "kind": kind}

    ops = [
        add(0, fam, True, f"<title>{fam}</title><content>use {right}</content>"),  # right, names the family
        add(1, fam, True, f"<title>x</title><content>{wrong} then {right}</content>"),  # first named is wrong
        add(1, other, False, "<title>y</title><content>nothing</content>"),
        add(3, fam, True, f"<title>z</title><content>red{right}doorx</content>"),  # glued: right and family
        add(3, fam, True, "<title>m</title><content>merged</content>", kind="merge"),  # a merge: not counted
        {"op": "touch", "uids": [0], "now": 1.0},
    ]
    (run / "experience" / "4" / "oplog.jsonl").write_text("".join(json.dumps(o) + "\n" for o in ops))
    out = em.audit_run(str(run))
    assert out["lessons"] == 4
    assert out["after_success_first_half_n"] == 2
    assert out["after_success_first_half_named"] == 1.0 and out["after_success_first_half_right"] == 0.5
    assert out["after_success_first_half_family"] == 0.5
    assert out["after_failure_first_half_n"] == 1 and out["after_failure_first_half_named"] == 0.0
    assert out["after_success_second_half_n"] == 1 and out["after_success_second_half_right"] == 1.0
    assert out["after_success_second_half_family"] == 1.0
    assert out["after_failure_second_half_n"] == 0 and out["after_failure_second_half_right"] is None
    json.dumps(out, allow_nan=False)
    # a run of a method without experience: the error names the directory
    (tmp_path / "baseline_s5").mkdir()
    (tmp_path / "baseline_s5" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no saved experience under"):
        em.audit_run(str(tmp_path / "baseline_s5"))
