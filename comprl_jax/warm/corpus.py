"""The warm-start corpus: synthetic instruction data that teaches a small actor to *use what applies* in its
experience block and a small extractor to *write what happened* as bank operations (issue 49).

What it teaches (HiddenRule's format: a locked object of a family, a colour and a kind, that opens with one of 8
verbs; ``envs/hidden_rule.py``):

* **Actor** (:class:`ActorExample`): a prompt exactly as a run builds it (the env's system prompt, 0-3 experience
  entries in the block of ``experience/retrieval.py`` or no block at all, the observation, and with ``attempts=3``
  the turns already played), and the reply :func:`reply`: ``<think>`` restating what follows the family's name
  where the experience block says it (the entry about that family, ``title: content``, or else the name alone)
  ``</think><answer>`` the action. An entry *applies* when its family is the observation's: a lesson that says
  verb V opens it -> play V; a lesson that says V failed, or a history where V failed -> never play V; an entry
  about another family, one that names a verb that is not an action, or no entry -> any action not known to fail,
  uniformly (nothing in the observation supports one). At most one entry is about the episode's family (a guided
  episode sees one retrieved entry); distractors are the other 15 families uniformly, wordings vary (:data:`WORKS`
  / :data:`FAILS`), and stale lessons (their verb failed in this very episode) occur, so that the skill is "use
  what applies", not "copy the first verb". Restating before answering turns reading into copying what came after
  an earlier occurrence of the same word, which a 4-layer model learns within a few hundred steps; answering
  directly needs a match of the observation's family against each entry's, which it had not learnt in 2,000.
* **Extractor** (:class:`ExtractorExample`): a distillation prompt exactly as the bank builds it
  (``experience/ops.distill_prompt`` over the episode's transcript, ``rollout/episodes.Trajectory``) with 0-5
  previous lessons, and the answer in the op grammar of ``experience/ops.py`` (:func:`extractor_answer`): after a
  success, a lesson naming the family and the verb that worked; after a failure, a lesson naming what failed and
  never claiming it works; an ``update`` replacing a previous lesson that the outcome contradicts.

What it must never contain: any run's rules or the held-out place names. Every example draws its family, its own
hidden verb and every lesson's verbs from the corpus's generator, seeded by the corpus seed alone (no run seed is an
input), so each (family, verb) pair is equally likely (tests/test_warm_corpus.py: chi-square over the corpus for
(goal family, target action) and (lesson family, lesson verb)); instances use the training place names only
(``hidden_rule.TRAIN_NAMES``, via the env's own training seeds).

Prompts are never written here: the actor's come from ``rollout.episodes`` (``first_input``, ``Episode.observe``)
and the extractor's from ``experience.ops.distill_prompt`` with the transcript of ``rollout.episodes.Trajectory``,
so a change of the run's prompt changes the corpus with it (tests check the equality).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np

from comprl_jax.envs import hidden_rule as hr
from comprl_jax.experience.ops import distill_prompt
from comprl_jax.experience.retrieval import format_entry, format_experience
from comprl_jax.rollout.episodes import Episode, EpisodeSpec, first_input
from comprl_jax.rollout.tasks import Task

ENV_ID = "comprl/HiddenRule-v0"
VERBS = hr.ACTIONS
FAMILIES = hr.FAMILIES
# Verbs that are not actions of the env: a lesson naming one does not apply (the actor acts as with none).
NOT_ACTIONS = ("shove", "tap", "twist", "rattle", "shake", "pry")
# Lesson contents (lowercase words and commas: the constrained extractor's grammar, loop.extractor_track.ops_regex).
# ``{v}``: one verb; ``{vs}``: one or more verbs joined by ", ". The extractor writes the first two of each; the
# actor reads all of them.
# Every wording names the family before its verbs (the title, which names it too, always comes first).
WORKS = ("to open a {f}, {v}", "the {f} opens with {v}", "a {f} opens if you {v}", "for a {f}, {v} works")
FAILS = ("on a {f}, {vs} failed", "the {f} jammed after {vs}", "a {f} does not open with {vs}")
WRITTEN = 2  # the extractor's wordings: WORKS[:2], FAILS[:2]
# Place names of half the examples besides the env's training names: held-out instances bring names the corpus
# never shows (hidden_rule.EVAL_NAMES), so reading must not hang on a known name's tokens. Real words first, then
# 2,000 made-up ones (syllables from a fixed generator): with the real ones alone (40) the actor learnt the
# experience block's use on training names and lost it on held-out ones (decision token 0.99 against 0.17-0.54,
# WORKSPACE issue 49): an unseen name's pieces, their embeddings never trained, derailed it.
_REAL_NAMES = (
    "quarry", "belfry", "cloister", "dungeon", "parlour", "scullery", "larder", "nursery", "study", "hall",
    "cellarage", "washroom", "chamber", "loft", "pavilion", "sanctum", "rotunda", "terrace", "courtyard", "cistern",
    "archive", "sacristy", "conservatory", "dovecote", "icehouse", "laundry", "mint", "oratory", "pottery", "refectory",
    "saddlery", "scriptorium", "solar", "spicery", "stillroom", "storeroom", "summerhouse", "undercroft", "wardrobe", "well",
)  # fmt: skip


def _made_up_names(n: int) -> tuple[str, ...]:
    """``n`` distinct pronounceable words of 2-3 syllables (a fixed generator: no run's seed), none a held-out or a
    training name of the env and none holding an action or a family word."""
    rng = np.random.default_rng(12345)
    onsets = ("b", "br", "c", "ch", "d", "f", "g", "gl", "h", "k", "l", "m", "n", "p", "pl", "r", "s", "sh", "st", "t",
              "th", "tr", "v", "w", "z")  # fmt: skip
    vowels = ("a", "e", "i", "o", "u", "ai", "ea", "oo", "ou", "y")
    codas = ("", "", "", "n", "r", "l", "s", "m", "ck", "nd", "rt", "st", "x")
    taken = set(hr.EVAL_NAMES) | set(hr.TRAIN_NAMES) | set(_REAL_NAMES)
    banned = set(hr.ACTIONS) | {w for f in hr.FAMILIES for w in f.split()} | set(hr.EVAL_NAMES)
    out: list[str] = []
    while len(out) < n:
        k = int(rng.integers(2, 4))
        w = "".join(
            str(rng.choice(onsets)) + str(rng.choice(vowels)) + str(rng.choice(codas)) for _ in range(k)
        )
        if w not in taken and not any(b in w for b in banned):
            taken.add(w)
            out.append(w)
    return tuple(out)


EXTRA_NAMES = _REAL_NAMES + _made_up_names(2000)
NEGATIONS = ("failed", "jammed", "does not", "not open")


@dataclasses.dataclass(frozen=True)
class Lesson:
    """One bank entry: ``verbs`` open ``family`` (``works``, one verb) or failed on it (one or more verbs)."""

    family: str
    verbs: tuple[str, ...]
    works: bool
    wording: int = 0

    @property
    def content(self) -> str:
        if self.works:
            return WORKS[self.wording].format(f=self.family, v=self.verbs[0])
        return FAILS[self.wording].format(f=self.family, vs=", ".join(self.verbs))

    @property
    def text(self) -> str:
        """The entry as the bank stores it (``<title>…</title><content>…</content>``, SPEC §4)."""
        return f"<title>{self.family}</title><content>{self.content}</content>"


def read_lesson(text: str) -> tuple[str | None, list[str], bool]:
    """``(family, verbs, works)`` of a lesson text in any form (entry text, ``title: content``, a model's words):
    the first family named (colour and kind together), the actions named in order, and whether it claims they work
    (no negation word). Used to audit what an extractor wrote (launch/bench/warm_start.py, the comparison's audit)."""
    low = text.lower()
    fams = sorted((low.find(f), f) for f in FAMILIES if f in low)
    family = fams[0][1] if fams else None
    found = sorted((i, v) for v in VERBS for i in _find_all(low, v))
    works = not any(n in low for n in NEGATIONS)
    return family, [v for _, v in found], works


def _find_all(text: str, word: str) -> list[int]:
    out, i = [], text.find(word)
    while i >= 0:
        before = text[i - 1] if i > 0 else " "
        after = text[i + len(word)] if i + len(word) < len(text) else " "
        if not before.isalpha() and not after.isalpha():  # whole words only ("turn" is not in "return")
            out.append(i)
        i = text.find(word, i + 1)
    return out


def lesson_is_right(text: str, family: str, verb: str) -> bool:
    """The lesson names ``family`` and claims that ``verb`` works (and claims no other verb)."""
    fam, verbs, works = read_lesson(text)
    return works and fam == family and bool(verbs) and set(verbs) == {verb}


def lesson_claims(text: str, verb: str) -> bool:
    """The lesson claims that ``verb`` works."""
    _, verbs, works = read_lesson(text)
    return works and verb in verbs


# -- the environment's own text ----------------------------------------------------------------------------------
def _names(extra: bool) -> tuple[str, ...]:
    return EXTRA_NAMES if extra else hr.TRAIN_NAMES


def reply(think: str, action: str) -> str:
    """The warm actor's reply: what applies, restated (a lesson line, or the family alone), then the action (the
    run's constrained decoding admits exactly this shape, ``actor.think_chars``)."""
    return f"<think>{think}</think><answer>{action}</answer>"


def play(
    attempts: int, seed: int, rule: str, actions: Sequence[str], extra_names: bool = False, think: str = ""
):
    """The real env's text for one instance: ``(system prompt, obs0, info0, [(reply, step result), ...])``, each
    action played as :func:`reply` with ``think`` (the family's name alone when empty).

    ``rule`` is this example's own hidden verb for the instance's family: it replaces the env's rule table, which
    is drawn from a run seed (``hidden_rule.rules``), so no run's rules ever enter the corpus."""
    env = hr.HiddenRuleEnv(attempts=attempts, train_names=_names(extra_names))
    obs, info = env.reset(seed=int(seed))
    env.rules = {info["family"]: (rule,)}  # the example's own rule, never a run's
    steps = []
    for a in actions:
        r = reply(think or info["family"], a)
        steps.append((r, env.step(r)))
    return env.system_prompt(), obs, info, steps


def _episode(
    system: str, experience: str, obs: str, info: dict, tok, guided: bool
) -> tuple[Episode, list[int]]:
    spec = EpisodeSpec(Task(ENV_ID, int(info["seed"]), 0), 0, guided, experience=experience)
    ids = first_input(system, spec, obs, tok, "")
    return Episode(spec, info, obs, ids, True, False, None), ids


# -- actor examples ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ActorExample:
    """One actor decision. ``entries`` None: a free episode (no experience block); ``()``: a guided one with
    "[No experience found]". ``history``: actions already played in this episode (each failed)."""

    attempts: int
    seed: int
    family: str
    rule: str
    entries: tuple[Lesson, ...] | None
    history: tuple[str, ...]
    target: str
    kind: str  # follow | avoid | stale | other | invalid_verb | none
    extra_names: bool = False

    @property
    def experience(self) -> str:
        return "" if self.entries is None else format_experience([e.text for e in self.entries])

    @property
    def think(self) -> str:
        """The family's name, then what follows it in the experience block where an entry is about it: that entry
        as the block shows it (``red door: to open a red door, push``), or else the name alone (``red door``).

        Why this shape: the token after the name is ``:`` only when an earlier ``name:`` (an entry's title) is in
        the prompt; one head matching the name's single token finds it, and its absence leaves the default (end
        the think). An earlier design copied the observation's sentence when no entry applied: both copies then
        started at the same name, the observation's occurrence won, and following fell from 0.89 to 0.28-0.41 as
        soon as examples without an applying entry were mixed in (WORKSPACE, issue 49)."""
        own = [e for e in self.entries or () if e.family == self.family]
        return format_entry(own[0].text) if own else self.family

    def decision_index(self, tok, target: Sequence[int]) -> int:
        """Index in ``target`` (this example's target ids) of the token after the family's name in the think: the
        one that says whether an entry about the family is in the block (``:`` and the entry, or ``</think>``)."""
        name = tok.encode(self.family)
        for k in range(len(target) - len(name) + 1):
            if list(target[k : k + len(name)]) == name:
                return k + len(name)
        raise ValueError(f"the target of {self} does not contain its family's name {self.family!r}")

    def ids(self, tok) -> tuple[list[int], list[int]]:
        """``(prompt ids, target ids)``: the context exactly as the rollout builds it (``first_input``, then per
        played turn the reply's ids, ``<|im_end|>`` and ``Episode.observe``'s next input), and the reply
        (:func:`reply`: the think restates the entry about the own family, then the action) with ``<|im_end|>``."""
        system, obs, info, steps = play(
            self.attempts, self.seed, self.rule, self.history, self.extra_names, self.think
        )
        ep, ids = _episode(system, self.experience, obs, info, tok, self.entries is not None)
        ctx = list(ids)
        for said, result in steps:
            ctx += tok.encode(said) + [tok.eos_id]
            if not ep.observe(said, result, ctx, tok, tok.eos_id):
                raise AssertionError(f"corpus example ended before its target turn: {self}")
            ctx += ep.pending
        return ctx, tok.encode(reply(self.think, self.target)) + [tok.eos_id]


def balanced_for_decision(examples: Sequence[ActorExample], rng: np.random.Generator) -> list[ActorExample]:
    """The examples whose block holds an entry about the own family, as many as those whose block holds entries but
    none about it (a random subset of the larger side), plus half as many without entries (free or empty block).

    Why: in the mixture ~74% of the prompts with entries hold one about the own family, and the shipped actor's
    decision token (``:`` or ``</think>`` after the name) sat at that base rate whatever the entries said (its
    bench's "copies another family's lesson" 0.755; WORKSPACE, issue 49): a balanced set removes the base rate as
    an answer, so only the match of the entry's title against the observation's family lowers the loss."""
    own = [a for a in examples if a.entries and a.think != a.family]
    absent = [a for a in examples if a.entries and a.think == a.family]
    rest = [a for a in examples if not a.entries]
    n = min(len(own), len(absent))
    pick = lambda xs, k: [xs[i] for i in sorted(rng.permutation(len(xs))[:k])]  # noqa: E731
    return pick(own, n) + pick(absent, n) + pick(rest, n // 2)


def _other_family(rng, family: str, near: bool) -> str:
    colour, kind = family.split(" ")
    if near:  # shares the colour or the kind: matching one word is not enough
        pool = [f for f in FAMILIES if f != family and (f.startswith(colour + " ") or f.endswith(" " + kind))]
    else:
        pool = [f for f in FAMILIES if f != family]
    return str(rng.choice(pool))


def _verbs(rng, k: int, exclude: Sequence[str] = ()) -> tuple[str, ...]:
    pool = [v for v in VERBS if v not in exclude]
    return tuple(str(v) for v in rng.choice(pool, size=min(k, len(pool)), replace=False))


def _distractor(rng, family: str) -> Lesson:
    # uniform over the other 15 families (6 of them share a colour or a kind): a bias towards near families would
    # teach their embeddings to be alike (the next-token term sees which families come together)
    other = _other_family(rng, family, near=False)
    if rng.random() < 0.6:
        return Lesson(other, (str(rng.choice(VERBS)),), True, int(rng.integers(len(WORKS))))
    return Lesson(other, _verbs(rng, int(rng.integers(1, 4))), False, int(rng.integers(len(FAILS))))


def _seed(rng, held_out: bool) -> int:
    """A training instance (never a held-out place name), or with ``held_out`` an evaluation one."""
    lo = hr.EVAL_SEEDS_FROM if held_out else 0
    return int(rng.integers(lo, lo + hr.EVAL_SEEDS_FROM))


def actor_example(rng: np.random.Generator, held_out: bool = False) -> ActorExample:
    """One actor example (see the module docstring for the mixture)."""
    attempts = 3 if rng.random() < 0.25 else 1
    seed = _seed(rng, held_out)
    extra = bool(rng.random() < 0.5)
    family = hr.instance(seed, train_names=_names(extra))[0]
    mode = rng.random()
    if mode < 0.2:
        entries, own = None, None  # free episode: no experience block
    elif mode < 0.3:
        entries, own = (), None  # "[No experience found]"
    else:
        own = rng.random()
        entries = ()
    lessons: list[Lesson] = []
    claim: str | None = None  # the verb an applying lesson says opens it
    failed: set[str] = set()  # verbs known to fail (own failure lessons, the history)
    kind = "none" if entries is None or own is None else "other"
    if own is not None and own < 0.75:
        r = rng.random()
        if r < 0.6:  # a claim about the own family (one entry about it at most: a guided episode sees one)
            if rng.random() < 0.1:
                v = str(rng.choice(NOT_ACTIONS))
                kind = "invalid_verb"
            else:
                v, kind = str(rng.choice(VERBS)), "follow"
                claim = v
            lessons.append(Lesson(family, (v,), True, int(rng.integers(len(WORKS)))))
        else:  # a failure lesson about the own family
            vs = _verbs(rng, int(rng.integers(1, 4)))
            failed.update(vs)
            lessons.append(Lesson(family, vs, False, int(rng.integers(len(FAILS)))))
            kind = "avoid"
    if entries is not None and own is not None:
        n_other = int(rng.integers(0 if lessons else 1, 4 - len(lessons)))
        lessons += [_distractor(rng, family) for _ in range(n_other)]
        order = rng.permutation(len(lessons))
        entries = tuple(lessons[i] for i in order)
    # turns already played (attempts=3): each failed; a stale claim is one whose verb is among them
    history: tuple[str, ...] = ()
    if attempts > 1:
        # at least two verbs stay possible (a target, and a rule that may differ from it)
        h = min(int(rng.integers(0, attempts)), len(VERBS) - len(failed) - 2)
        if h > 0:
            if claim is not None and rng.random() < 0.5:
                history = (claim,) + _verbs(rng, h - 1, exclude=[*failed, claim])  # the lesson went stale
                history = tuple(history[i] for i in rng.permutation(len(history)))
                kind = "stale"
            else:
                history = _verbs(rng, h, exclude=[*failed, *([claim] if claim else [])])
    failed.update(history)
    if claim is not None and claim not in failed:
        target = claim
        rule = claim
    else:
        allowed = [v for v in VERBS if v not in failed]
        target = str(rng.choice(allowed))
        # the hidden verb: anything not yet seen failing (the target itself is a fair guess, not the answer)
        rule = str(rng.choice(allowed))
    return ActorExample(attempts, seed, family, rule, entries, history, target, kind, extra)


# -- extractor examples ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ExtractorExample:
    """One distillation: the episode (``played`` actions; it succeeded iff the last one is ``rule``), the previous
    lessons shown, and the answer (an ``<answer>[…]</answer>`` op list)."""

    attempts: int
    seed: int
    family: str
    rule: str
    played: tuple[str, ...]
    previous: tuple[Lesson, ...]
    answer: str
    kind: str  # add_works | fix_claim_success | add_failed | fix_claim
    extra_names: bool = False
    think: str = ""  # what the actor restated before acting (the family's name alone when empty)

    @property
    def success(self) -> bool:
        return bool(self.played) and self.played[-1] == self.rule

    def prompt(self, max_chars: int, transcript_chars: int) -> tuple[str, str]:
        """``(goal, distillation prompt)`` exactly as the bank builds it for this episode."""
        _, obs, info, steps = play(
            self.attempts, self.seed, self.rule, self.played, self.extra_names, self.think
        )
        ep = Episode(EpisodeSpec(Task(ENV_ID, self.seed, 0), 0, False), info, obs, [], True, False, None)
        for said, result in steps:
            ep.step(said, result)
        traj = ep.trajectory([], [], [])
        if traj.success != self.success:
            raise AssertionError(f"corpus episode's outcome differs from the env's: {self}")
        text = traj.transcript_text(transcript_chars)
        return traj.goal, distill_prompt(
            traj.goal, traj.success, text, [x.text for x in self.previous], max_chars
        )

    def ids(self, tok, max_chars: int, transcript_chars: int, context: int, max_new: int):
        """``(prompt ids, target ids)``: the prompt as ``ExtractorTrack.generate`` encodes and truncates it."""
        _, prompt = self.prompt(max_chars, transcript_chars)
        ids = tok.encode_user_prompt(prompt)
        return ids[-(context - max_new) :], tok.encode(self.answer)


def ops_answer(ops: Sequence[dict]) -> str:
    """An op list in the extractor's answer format (``json.dumps``: the separators of the constrained grammar)."""
    return f"<answer>{json.dumps(list(ops))}</answer>"


def _add(lesson: Lesson) -> dict:
    return {"function_name": "add", "parameters": {"new_memory": lesson.text}}


def _update(targets: Sequence[int], lesson: Lesson) -> dict:
    return {
        "function_name": "update",
        "parameters": {"target_idx": [i + 1 for i in targets], "new_memory": lesson.text},
    }


RETURN = {"function_name": "return"}


def extractor_answer(
    family: str, played: Sequence[str], success: bool, previous: Sequence[Lesson], rng
) -> tuple[str, str]:
    """``(answer, kind)``: what the extractor should write for an episode, given the previous lessons shown.

    A success adds the lesson that the verb it played last opens the family; a failure adds the lesson that the
    verbs it played failed. A previous lesson that this episode contradicts (it claims another verb opens the
    family after a success, or a verb that just failed after a failure) is replaced instead (``update``). Nothing
    else is compared with the bank: a family may hold several lessons (the bank's retrieval ranks them)."""
    claims = [i for i, x in enumerate(previous) if x.family == family and x.works]
    tried = tuple(dict.fromkeys(played))
    if success:
        verb = played[-1]
        new = Lesson(family, (verb,), True, int(rng.integers(WRITTEN)))
        wrong = [i for i in claims if previous[i].verbs[0] != verb]
        if wrong:
            return ops_answer([_update(wrong, new)]), "fix_claim_success"
        return ops_answer([_add(new)]), "add_works"
    new = Lesson(family, tried, False, int(rng.integers(WRITTEN)))
    contradicted = [i for i in claims if previous[i].verbs[0] in tried]
    if contradicted:
        return ops_answer([_update(contradicted, new)]), "fix_claim"
    return ops_answer([_add(new)]), "add_failed"


def extractor_example(rng: np.random.Generator, held_out: bool = False) -> ExtractorExample:
    """One extractor example (see the module docstring)."""
    attempts = 3 if rng.random() < 0.3 else 1
    seed = _seed(rng, held_out)
    extra = bool(rng.random() < 0.5)
    family = hr.instance(seed, train_names=_names(extra))[0]
    rule = str(rng.choice(VERBS))
    wrong = [v for v in VERBS if v != rule]
    success = bool(rng.random() < 0.5)
    if attempts == 1:
        played = (rule,) if success else (str(rng.choice(wrong)),)
    else:
        k = int(rng.integers(0, attempts)) if success else attempts
        misses = tuple(str(v) for v in rng.choice(wrong, size=k, replace=False))
        played = misses + ((rule,) if success else ())
    n_prev = 0 if rng.random() < 0.25 else int(rng.integers(1, 6))
    previous: list[Lesson] = []
    if n_prev and rng.random() < 0.7:  # lessons about the episode's own family
        for _ in range(1 if rng.random() < 0.7 else 2):
            r = rng.random()
            if r < 0.35:
                previous.append(Lesson(family, (rule,), True, int(rng.integers(WRITTEN))))
            elif r < 0.55:  # a wrong claim (an extractor's mistake)
                previous.append(Lesson(family, (str(rng.choice(wrong)),), True, int(rng.integers(WRITTEN))))
            else:
                vs = tuple(str(v) for v in rng.choice(wrong, size=int(rng.integers(1, 4)), replace=False))
                previous.append(Lesson(family, vs, False, int(rng.integers(WRITTEN))))
    while len(previous) < n_prev:
        previous.append(_distractor(rng, family))
    previous = [previous[i] for i in rng.permutation(len(previous))]
    answer, kind = extractor_answer(family, played, success, previous, rng)
    # what the actor thought: the family's name alone, or a lesson about it (which need not be what it then did)
    think = ""
    if rng.random() < 0.5:
        shown = Lesson(family, (str(rng.choice(VERBS)),), True, int(rng.integers(len(WORKS))))
        if rng.random() < 0.4:
            shown = Lesson(family, _verbs(rng, int(rng.integers(1, 4))), False, int(rng.integers(len(FAILS))))
        think = format_entry(shown.text)
    return ExtractorExample(attempts, seed, family, rule, played, tuple(previous), answer, kind, extra, think)


def examples(kind: str, seed: int, n: int, held_out: bool = False) -> list:
    """``n`` examples of ``kind`` (``"actor"`` / ``"extractor"``) from the corpus seed ``seed`` (the only input).
    ``held_out``: on held-out instances (evaluation seeds, held-out place names): measurement material, never
    training data."""
    make = {"actor": actor_example, "extractor": extractor_example}[kind]
    rng = np.random.default_rng([int(seed), 49, 0 if kind == "actor" else 1, int(held_out)])
    return [make(rng, held_out) for _ in range(n)]


def atomic_words() -> list[str]:
    """Words the warm vocabulary keeps as one token each: the actions and the family names."""
    return [*VERBS, *FAMILIES]


# The warm models' size (launch/warm_start.py): a 4-layer, 128-wide Qwen3 with 8 heads of 16.
# 4 heads of 64 (not 8 of 16): with q/k norms a head's logits are bounded by ~sqrt(head_dim) x its norm gains, and
# telling whether an entry names the episode's family needs one sharp match among ~80 positions
MODEL_DIMS = dict(hidden=128, layers=4, heads=4, kv_heads=4, ff=320, head_dim=64)
