"""The warm-start corpus (issue 49): it holds no run's rules and no held-out name, its prompts are the run's own,
and its answers are what the module docstring says, in the op grammar the constrained extractor decodes."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest
from scipy import stats

from comprl_jax.envs import hidden_rule as hr
from comprl_jax.experience import BankConfig
from comprl_jax.experience.manager import DistillRequest, ExperienceManager, ManagerConfig
from comprl_jax.experience.ops import parse_ops
from comprl_jax.loop.extractor_track import ops_regex
from comprl_jax.rollout.episodes import start_episodes
from comprl_jax.warm import corpus as C
from comprl_jax.warm import vocab as V


@pytest.fixture(scope="module")
def boot():
    return V.bootstrap_tokenizer()


def _chi2_uniform(pairs, rows, cols) -> float:
    counts = collections.Counter(pairs)
    table = np.array([[counts[(r, c)] for c in cols] for r in rows], float).ravel()
    assert table.sum() == len(pairs)
    return stats.chisquare(table).pvalue


def test_the_corpus_holds_no_rules_both_joint_distributions_are_uniform():
    """(goal family, target action) over actor examples and (lesson family, lesson verb) over every lesson the
    corpus shows or writes are uniform (chi-square; a run's rules would make some pairs far more frequent: a
    corpus built from one rule table fails this test, checked below)."""
    actors = C.examples("actor", 0, 16_000)
    extractors = C.examples("extractor", 0, 8_000)
    goal = [(a.family, a.target) for a in actors]
    p_goal = _chi2_uniform(goal, hr.FAMILIES, hr.ACTIONS)
    lessons = [x for a in actors for x in (a.entries or ())] + [x for e in extractors for x in e.previous]
    for e in extractors:
        for op in parse_ops(e.answer, len(e.previous), 1000).ops:
            lessons.append(_lesson_of(op.new_memory))
    pairs = [(x.family, v) for x in lessons for v in x.verbs if v in hr.ACTIONS]
    p_lesson = _chi2_uniform(pairs, hr.FAMILIES, hr.ACTIONS)
    assert p_goal > 1e-3 and p_lesson > 1e-3, (p_goal, p_lesson)
    # the test has power: the same pairs with one run's rules mixed into a tenth of them are rejected
    rules = hr.rules(0)
    biased = goal + [(f, rules[f][0]) for f, _ in goal[: len(goal) // 10]]
    assert _chi2_uniform(biased, hr.FAMILIES, hr.ACTIONS) < 1e-6


def _lesson_of(text: str) -> C.Lesson:
    fam, verbs, works = C.read_lesson(text)
    return C.Lesson(fam, tuple(verbs), works)


def test_no_held_out_place_name_and_no_run_seed(boot):
    for a in C.examples("actor", 3, 300):
        text = boot.decode(sum(a.ids(boot), []))
        assert not any(n in text for n in hr.EVAL_NAMES), text
    for e in C.examples("extractor", 3, 300):
        _, prompt = e.prompt(200, 1000)
        assert not any(n in prompt for n in hr.EVAL_NAMES), prompt
    # the generator's only input is the corpus seed: same seed, same corpus; its rules vary per example
    assert C.examples("actor", 5, 50) == C.examples("actor", 5, 50)
    follow = [a for a in C.examples("actor", 0, 4000) if a.kind == "follow" and a.family == "red door"]
    assert {a.target for a in follow} == set(hr.ACTIONS)


def test_actor_prompts_are_the_rollouts_own(boot):
    """A one-turn example's prompt equals what the rollout starts an episode with (start_episodes), for the same
    env text and experience block; a multi-turn one extends it with the rollout's next inputs."""
    seen = collections.Counter()
    for a in C.examples("actor", 1, 400):
        prompt, target = a.ids(boot)
        system, obs, info, _ = C.play(a.attempts, a.seed, a.rule, (), a.extra_names, a.think)
        spec = C.EpisodeSpec(C.Task(C.ENV_ID, a.seed, 0), 0, a.entries is not None, experience=a.experience)
        ep = start_episodes({C.ENV_ID: system}, [spec], [(obs, info)], boot, "")[0]
        assert prompt[: len(ep.pending)] == ep.pending
        if not a.history:
            assert prompt == ep.pending
        assert boot.decode(target) == C.reply(a.think, a.target) + "<|im_end|>"
        own = [x for x in a.entries or () if x.family == a.family]
        assert len(own) <= 1
        if own:  # the entry about the episode's family, as the block shows it
            assert a.think == C.format_entry(own[0].text)
        else:  # no entry about it: the name alone
            assert a.think == a.family
        seen[a.kind] += 1
    assert set(seen) == {"follow", "avoid", "stale", "other", "invalid_verb", "none"}


def test_extractor_prompts_are_the_banks_own():
    """The corpus's distillation prompt equals the one the bank builds (ExperienceManager.distill_prompts) for the
    same episode with the same lessons shown."""

    def embed(texts):
        return np.stack([np.random.default_rng(abs(hash(t)) % 2**32).normal(size=8) for t in texts]).astype(
            np.float32
        )

    for e in C.examples("extractor", 2, 40):
        mgr = ExperienceManager(
            embed, 8, bank_cfg=BankConfig(max_entry_chars=200), cfg=ManagerConfig(num_previous=5)
        )
        try:
            uids = []
            for x in e.previous:
                got = mgr.apply_output(C.ENV_ID, C.ops_answer([C._add(x)]), [], step=0)
                uids += got.added
            goal, prompt = e.prompt(200, 1000)
            traj_text = prompt.split("Trajectory:\n", 1)[1].split("\n\nPrevious lessons:", 1)[0]
            req = DistillRequest(C.ENV_ID, goal, e.success, traj_text, goal, tuple(uids))
            _, prompts = mgr.distill_prompts([req])
            assert prompts[0] == prompt
        finally:
            mgr.close()


def test_extractor_answers_follow_the_grammar_and_the_rules_of_the_docstring():
    grammar = re.compile(ops_regex())
    kinds = collections.Counter()
    for e in C.examples("extractor", 4, 3000):
        assert grammar.fullmatch(e.answer), e.answer
        res = parse_ops(e.answer, len(e.previous), 200)
        assert not res.rejected
        kinds[e.kind] += 1
        claims = [i for i, x in enumerate(e.previous) if x.family == e.family and x.works]
        assert len(res.ops) == 1
        op = res.ops[0]
        fam, verbs, works = C.read_lesson(op.new_memory)
        assert fam == e.family
        if e.success:  # after a success: the verb that worked, claimed to work
            assert works and verbs == [e.rule]
            wrong = [i for i in claims if e.previous[i].verbs[0] != e.rule]
        else:  # after a failure: what failed, never claimed to work
            assert not works and verbs == list(dict.fromkeys(e.played)) and e.rule not in verbs
            wrong = [i for i in claims if e.previous[i].verbs[0] in e.played]
        # only the lessons the outcome contradicts are replaced
        assert (op.function, op.targets) == (("update", tuple(wrong)) if wrong else ("add", ()))
    assert set(kinds) == {"add_works", "fix_claim_success", "add_failed", "fix_claim"}


def test_read_lesson_by_hand():
    assert C.read_lesson("<title>red door</title><content>to open a red door, knock</content>") == (
        "red door",
        ["knock"],
        True,
    )
    assert C.read_lesson("red gate: on a red gate, kick, pull failed") == (
        "red gate",
        ["kick", "pull"],
        False,
    )
    assert C.read_lesson("nothing here about return or turning") == (None, [], True)  # whole words only
    assert C.lesson_is_right("blue chest: the blue chest opens with lift", "blue chest", "lift")
    assert not C.lesson_is_right("blue chest: the blue chest opens with lift", "blue gate", "lift")
    assert not C.lesson_is_right("blue chest: a blue chest does not open with lift", "blue chest", "lift")
    assert C.lesson_claims("for a red door, push works", "push")
    assert not C.lesson_claims("on a red door, push failed", "push")
    # every wording the corpus uses reads back as what it says
    for w in range(len(C.WORKS)):
        x = C.Lesson("green hatch", ("slide",), True, w)
        assert C.read_lesson(x.text) == ("green hatch", ["slide"], True)
    for w in range(len(C.FAILS)):
        x = C.Lesson("green hatch", ("slide", "turn"), False, w)
        assert C.read_lesson(x.text) == ("green hatch", ["slide", "turn"], False)


def test_the_vocabulary_keeps_actions_and_families_whole_and_round_trips(tmp_path, boot):
    texts = [boot.decode(sum(a.ids(boot), [])) for a in C.examples("actor", 0, 300)]
    path = V.train_vocab(texts, 1024, C.atomic_words(), str(tmp_path))
    tok = C_tok(path)
    assert tok.kind == "metaspace"
    for w in C.atomic_words():
        assert len(tok.encode(w)) == 1 and tok.decode(tok.encode(w)) == w
    odd = "Observation: é ü \u2603 in the lighthouse <answer>kick</answer>"
    assert tok.decode(tok.encode(odd)) == odd  # byte fallback: any text round-trips
    ids = tok.encode("the red door opens with knock")
    assert [tok.decode([i]) for i in ids][-1] == "knock"


def C_tok(path):
    from comprl_jax.tokenizer import Tokenizer

    return Tokenizer.from_hf_json(path)
