"""What a frozen warm model does with lessons, measured by play on held-out material (launch/bench/warm_start.py).

The actor plays HiddenRule's held-out instances (evaluation seeds: place names the corpus never shows) of a run's
rules (``rule_seed``) through the trainer's own rollout (sampler, constrained decoding, the run's temperature), with
an experience block built for the condition; the extractor writes distillations of held-out episodes through the
trainer's own extractor call (``ExtractorTrack.generate``: its grammar and temperature). Nothing trains.

Actor conditions (each episode one action; ``code_len=1``, ``attempts=1``):
  follow        its own family's true lesson among 0-2 other families' lessons, in random order
  no_lesson     no experience block (a free episode)
  empty         the block says "[No experience found]"
  other_family  one lesson, about another family (its verb is that family's rule)
  failed        its own family's lesson that a verb V (not the rule) failed
Extractor conditions: after a success with 0-3 other families' lessons shown (an ``add`` is due), after a success
with a wrong claim about its own family shown too (an ``update`` of that claim is due), after a failure (the
lesson must not claim the failed verb works).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from comprl_jax.envs import hidden_rule as hr
from comprl_jax.envs.base import parse_answer
from comprl_jax.experience.ops import parse_ops
from comprl_jax.experience.retrieval import format_experience
from comprl_jax.rollout.episodes import EpisodeSpec
from comprl_jax.rollout.tasks import Task
from comprl_jax.warm import corpus as C

ENV = C.ENV_ID
ACTOR_CONDITIONS = ("follow", "no_lesson", "empty", "other_family", "failed")


@dataclasses.dataclass(frozen=True)
class Trial:
    condition: str
    seed: int
    family: str
    entries: tuple[C.Lesson, ...] | None
    named: (
        str | None
    )  # the verb the condition's lesson names (follow: the rule; other_family / failed: its verb)


def actor_trials(rule_seed: int, n: int, rng: np.random.Generator) -> list[Trial]:
    """``n`` held-out episodes per condition for the rules of ``rule_seed``."""
    rules = hr.rules(rule_seed)
    out = []
    for cond in ACTOR_CONDITIONS:
        for _ in range(n):
            seed = int(rng.integers(hr.EVAL_SEEDS_FROM, 2 * hr.EVAL_SEEDS_FROM))
            fam = hr.instance(seed)[0]
            rule = rules[fam][0]
            wording = lambda k: int(rng.integers(k))  # noqa: E731
            if cond == "follow":
                own = C.Lesson(fam, (rule,), True, wording(len(C.WORKS)))
                others = [_true_lesson(rng, rules, fam) for _ in range(int(rng.integers(0, 3)))]
                entries = [own, *others]
                entries = tuple(entries[i] for i in rng.permutation(len(entries)))
                out.append(Trial(cond, seed, fam, entries, rule))
            elif cond == "no_lesson":
                out.append(Trial(cond, seed, fam, None, None))
            elif cond == "empty":
                out.append(Trial(cond, seed, fam, (), None))
            elif cond == "other_family":
                x = _true_lesson(rng, rules, fam)
                out.append(Trial(cond, seed, fam, (x,), x.verbs[0]))
            else:
                v = str(rng.choice([a for a in hr.ACTIONS if a != rule]))
                out.append(Trial(cond, seed, fam, (C.Lesson(fam, (v,), False, wording(len(C.FAILS))),), v))
    return out


def _true_lesson(rng, rules, family: str) -> C.Lesson:
    other = str(rng.choice([f for f in hr.FAMILIES if f != family]))
    return C.Lesson(other, rules[other], True, int(rng.integers(len(C.WORKS))))


def play_actor(trainer, trials: list[Trial], key) -> list[dict]:
    """Plays every trial once through the trainer's rollout (``record=False``: nothing of the run changes)."""
    lim = trainer.limits[ENV]
    specs = []
    for i, t in enumerate(trials):
        block = "" if t.entries is None else format_experience([e.text for e in t.entries])
        specs.append(
            EpisodeSpec(
                Task(ENV, t.seed, 0),
                i,
                False,
                experience=block,
                turn_tokens=lim.turn_tokens,
                context=lim.context,
            )
        )
    # Play the trials as many at a time as the eval pool has lanes (the trainer sizes it: tasks x group).
    pools, trajs = trainer.eval_pools(None), []
    lanes = pools.pools[ENV].num_slots
    for i in range(0, len(specs), lanes):
        got, _ = trainer.play(
            specs[i : i + lanes], pools, step=0, key=jax.random.fold_in(key, i // lanes), record=False
        )
        trajs += got
    out = []
    for t, tr in zip(trials, trajs, strict=True):
        played = parse_answer(tr.transcript[0][1]) if tr.transcript else None
        out.append(
            {"condition": t.condition, "played": played, "named": t.named, "success": bool(tr.success)}
        )
    return out


def actor_figures(results: list[dict]) -> dict:
    """The bench's actor figures (see module docstring); ``n_<condition>`` episodes each."""

    def rate(cond, fn):
        sel = [r for r in results if r["condition"] == cond]
        return (float(np.mean([fn(r) for r in sel])) if sel else float("nan")), len(sel)

    plays_named = lambda r: r["played"] == r["named"]  # noqa: E731
    succ = lambda r: r["success"]  # noqa: E731
    out = {}
    out["actor_follow"], out["n_follow"] = rate("follow", plays_named)
    out["actor_follow_success"], _ = rate("follow", succ)
    out["actor_no_lesson_success"], out["n_no_lesson"] = rate("no_lesson", succ)
    out["actor_empty_block_success"], out["n_empty"] = rate("empty", succ)
    out["actor_copies_other_family"], out["n_other_family"] = rate("other_family", plays_named)
    out["actor_other_family_success"], _ = rate("other_family", succ)
    out["actor_plays_failed_verb"], out["n_failed"] = rate("failed", plays_named)
    return out


@dataclasses.dataclass(frozen=True)
class Distillation:
    condition: str  # success_add | success_update | failure
    example: C.ExtractorExample


def extractor_trials(rule_seed: int, n: int, rng: np.random.Generator) -> list[Distillation]:
    """``n`` held-out distillations per condition for the rules of ``rule_seed`` (one action per episode)."""
    rules = hr.rules(rule_seed)
    out = []
    for cond in ("success_add", "success_fix", "failure"):
        for _ in range(n):
            seed = int(rng.integers(hr.EVAL_SEEDS_FROM, 2 * hr.EVAL_SEEDS_FROM))
            fam = hr.instance(seed)[0]
            rule = rules[fam][0]
            wrong = [a for a in hr.ACTIONS if a != rule]
            prev = [_true_lesson(rng, rules, fam) for _ in range(int(rng.integers(0, 4)))]
            if cond == "success_fix":  # a wrong claim about the episode's family, which the success corrects
                prev.append(C.Lesson(fam, (str(rng.choice(wrong)),), True, int(rng.integers(C.WRITTEN))))
            prev = [prev[i] for i in rng.permutation(len(prev))]
            played = (rule,) if cond != "failure" else (str(rng.choice(wrong)),)
            ex = C.ExtractorExample(1, seed, fam, rule, played, tuple(prev), "", cond)
            out.append(Distillation(cond, ex))
    return out


def write_lessons(trainer, trials: list[Distillation], key) -> list[dict]:
    """The extractor's answers to the trials' prompts (one call), each read as the bank would parse it."""
    x = trainer.config
    prompts = [d.example.prompt(x.bank.max_entry_chars, x.extractor.transcript_chars)[1] for d in trials]
    gens = trainer.track.generate(prompts, key)
    out = []
    for d, g in zip(trials, gens, strict=True):
        res = parse_ops(g.text, len(d.example.previous), x.bank.max_entry_chars)
        lessons = [op.new_memory for op in res.ops if op.new_memory]
        e = d.example
        out.append(
            {
                "condition": d.condition,
                "text": g.text,
                "ops": [op.function for op in res.ops] + ["return"] * res.num_returns,
                "right": any(C.lesson_is_right(t, e.family, e.rule) for t in lessons),
                # the one op replaces exactly the wrong claim shown (success_fix)
                "fixed": [(op.function, op.targets) for op in res.ops]
                == [("update", tuple(i for i, x in enumerate(e.previous) if x.family == e.family))],
                "false_claim": any(C.lesson_claims(t, e.played[-1]) for t in lessons) and not e.success,
                "names_failure": (not e.success)
                and any(
                    C.read_lesson(t)[0] == e.family and e.played[-1] in C.read_lesson(t)[1] for t in lessons
                ),
            }
        )
    return out


def extractor_figures(results: list[dict], prefix: str = "extractor") -> dict:
    def mean(cond_set, k):
        sel = [r[k] for r in results if r["condition"] in cond_set]
        return float(np.mean(sel)) if sel else float("nan")

    succ = ("success_add", "success_fix")
    return {
        f"{prefix}_right_after_success": mean(succ, "right"),
        f"{prefix}_right_after_success_add": mean(("success_add",), "right"),
        f"{prefix}_right_after_success_fix": mean(("success_fix",), "right"),
        f"{prefix}_fix_updates_the_wrong_claim": mean(("success_fix",), "fixed"),
        f"{prefix}_false_claim_after_failure": mean(("failure",), "false_claim"),
        f"{prefix}_names_failure_after_failure": mean(("failure",), "names_failure"),
        f"{prefix}_n": len(results),
    }


def keys(seed: int, n: int):
    return [jax.random.fold_in(jax.random.key(seed), i) for i in range(n)]
