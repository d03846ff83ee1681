"""Each side of the Complementary RL loop with the other side scripted, on HiddenRule (issue 31).

  python launch/bench/experience_matters.py --side=actor --seeds=0,1,2 --steps=12
  python launch/bench/experience_matters.py --side=extractor --seeds=0,1,2 --steps=12

* ``--side=actor``: the real ``:cpu`` actor trains (``static_online``: the extractor is frozen) while the
  extractor's generation is replaced by :class:`OracleExtractor`, which writes the true rule of the episode's family
  after a success and nothing after a failure. Question: does the trained actor learn to *use* the lesson? Per step:
  success of the guided half and of the free half, the fraction of guided episodes whose retrieved lesson is about
  their own family (``hit``), and the fraction that played the action the lesson names (``follow``).
* ``--side=extractor``: the real ``:cpu`` extractor trains (``exp_only``: CISPO on entry rewards) while the actor is
  replaced by :class:`ScriptedReader`, which plays the first valid action a retrieved lesson names and acts
  uniformly otherwise. Question: does CISPO raise the fraction of lessons that name the right action, and the
  extractor's mean reward? Per step: the fraction of this step's distilled lessons that name the family's rule
  (``right``) or any valid action (``named``), the extractor's reward mean over its updates so far, and the reader's
  guided success.
* ``--side=both``: nothing trains; the oracle writes and the reader reads. What it checks is the information path
  itself: a lesson written after one success reaches later episodes of the same family through the real bank,
  embedder, Eq. 6 retrieval and system prompt, and changes what they do (guided success above free).
* ``--audit=GLOB``: no training; reads the experience op log of finished runs (e.g. the complementary arms of
  ``compare_cpu.sh``) and prints one line per run (``bench: "lesson_audit"``): of the lessons the extractor added
  after a success and after a failure, the share that names any valid action, the share whose first named action
  is the rule of the episode's family (``right``; chance among named ones 1/8), and the share that names the
  family (colour and kind), over the first and the second half of the run's steps. What the full loop's extractor
  writes, the link ``--side=extractor`` checks with a scripted reader.
* ``--prefill`` (actor and both sides): the bank starts with one true lesson per family, so that reading can be
  measured from step 0 without waiting for the bank to cover the 16 families.

Both scripted stand-ins are for experiments only (tests/test_experience_matters.py); they are not method options.
Search & ask is off on both sides (neither stand-in asks or answers), and so is the merge on the actor side (the
oracle only distils). One JSON line per step (``bench: "experience_matters_step"``), then one per run (``bench:
"experience_matters"``) with the first-half and second-half means.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Sequence

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from comprl_jax import config as config_lib
from comprl_jax.envs import hidden_rule as hr
from comprl_jax.envs.base import parse_answer
from comprl_jax.experience.ops import parse_ops
from comprl_jax.experience.retrieval import EXPERIENCE_HEADER, format_entry
from comprl_jax.rollout.episodes import start_episodes
from comprl_jax.rollout.pools import lanes

ENV = "comprl/HiddenRule-v0"
CONFIG = "configs/hidden_rule.py"
_GOAL_RE = re.compile(r"^Goal: Open the ([a-z]+ [a-z]+) in the", re.MULTILINE)
RETURN_OP = '<answer>[{"function_name": "return"}]</answer>'


def lesson_op(family: str, code: Sequence[str]) -> str:
    """The extractor output that adds the lesson of ``family``'s rule (the ops format of experience/ops.py)."""
    content = f"to open a {family}, {' then '.join(code)}"
    memory = f"<title>{family}</title><content>{content}</content>"
    return '<answer>[{"function_name": "add", "parameters": {"new_memory": "' + memory + '"}}]</answer>'


def named_actions(text: str, actions: Sequence[str] = hr.ACTIONS) -> list[str]:
    """The valid actions ``text`` names, in the order they occur. A name counts wherever it occurs, inside a longer
    word too: a tiny extractor's vocabulary holds each action as one token without a leading space, so its lessons
    spell an action glued to its neighbours ("themknock"); a token-level reader sees the action there."""
    low = text.lower()
    found = sorted((m.start(), a) for a in actions for m in re.finditer(re.escape(a), low))
    return [a for _, a in found]


def lesson_texts(response: str) -> list[str]:
    """The lessons an extractor output adds (``title: content``, as the actor's block shows them), by the bank's own
    parser."""
    return [format_entry(op.new_memory) for op in parse_ops(response, 0, 1 << 20).ops if op.new_memory]


def block_lessons(block: str) -> str:
    """The lesson text of an experience block (its header removed)."""
    return block.replace(EXPERIENCE_HEADER, "")


def family_of(text: str) -> str | None:
    """The HiddenRule family a distillation prompt's goal names."""
    m = _GOAL_RE.search(text)
    return m.group(1) if m else None


class OracleExtractor:
    """Test-only extractor (not a method option), in place of ``ExtractorTrack.generate``: a distillation prompt of
    a successful episode gets one ``add`` op holding the true rule of the goal's family; a failed one, or any other
    prompt, gets ``return``. Returns text, which the manager applies as it applies a model's output."""

    def __init__(self, rules: dict[str, tuple[str, ...]]):
        self.rules = rules
        self.written = 0

    def __call__(self, prompts: Sequence[str], key=None, version=None) -> list[str]:
        out = []
        for p in prompts:
            family = family_of(p)
            if family in self.rules and "\nOutcome: SUCCESS" in p:
                out.append(lesson_op(family, self.rules[family]))
                self.written += 1
            else:
                out.append(RETURN_OP)
        return out


@dataclasses.dataclass
class ScriptedReader:
    """Test-only actor (an :class:`~comprl_jax.rollout.engine.Engine`): in each episode, plays the valid actions its
    experience block names, in order, then uniformly random valid actions; with no named action (a free episode, an
    empty or blank block) it acts uniformly from the start. Trajectories carry no tokens (the actor does not train)."""

    seed: int
    calls: int = 0

    def play(self, r, specs, resets, key):
        rng = np.random.default_rng([self.seed, self.calls])
        self.calls += 1
        t0 = time.perf_counter()
        eps = start_episodes(r.pools.system_prompts, specs, resets, r.tokenizer, "")
        lane = lanes(specs)
        plans = [named_actions(block_lessons(s.experience)) if s.guided else [] for s in specs]
        for turn in range(r.max_turns):
            live = [b for b, e in enumerate(eps) if e.live]
            if not live:
                break
            futs = {}
            for b in live:
                actions = r.pools.action_spaces[specs[b].task.env_id][0]
                act = plans[b][turn] if turn < len(plans[b]) else str(rng.choice(actions))
                reply = f"<answer>{act}</answer>"
                futs[b] = (reply, r.pools.pools[specs[b].task.env_id].submit_step(lane[b], reply))
            for b, (reply, fut) in futs.items():
                eps[b].step(reply, fut.result())
        trajs = [e.trajectory([], [], []) for e in eps]
        return trajs, {"gen_s": 0.0, "env_s": time.perf_counter() - t0}


def load(side: str, seed: int, steps: int, overrides: Sequence[str] = (), scale: str = "cpu"):
    """The HiddenRule config of one side at ``scale`` (``cpu``: tiny random-init models; ``smollm``: SmolLM2):
    ``static_online`` (actor side) or ``exp_only`` (extractor side), search & ask off, and on the actor side no
    merge."""
    method = {"actor": "static_online", "extractor": "exp_only", "both": "exp_only"}[side]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    c = config_lib.load_file(os.path.join(repo, CONFIG) + f":{scale},{method}")
    with c.unlocked():
        c.seed = seed
        c.train.steps = steps
        c.checkpoint.every = 10**6
        c.retrieval.search_and_ask = False
        if side in ("actor", "both"):
            c.bank.merge = False
        if side == "both":  # nothing trains: the oracle writes, the reader reads
            c.method = "custom"
            c.extractor.train = False
        for item in overrides:
            key, _, value = item.partition("=")
            config_lib.set_key(c, key, json.loads(value))
    return c


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and np.isnan(x))]
    return float(np.mean(xs)) if xs else float("nan")


def run(
    side: str,
    seed: int,
    steps: int,
    workdir: str,
    overrides: Sequence[str] = (),
    log=print,
    scale: str = "cpu",
    prefill: bool = False,
) -> dict:
    """One run of one side; returns the per-step rows and the summary (also logged as JSON lines). ``prefill``
    (actor side): the bank starts with one true lesson per family."""
    from comprl_jax.loop.trainer import Trainer

    c = load(side, seed, steps, overrides, scale)
    rules = hr.rules(c.seed)
    reader = ScriptedReader(seed) if side in ("extractor", "both") else None
    tr = Trainer(c, workdir, engine=reader)
    captured: dict[str, list] = {"trajs": [], "lessons": []}
    play = tr.rollout

    def rollout(*a, **k):
        trajs, timing = play(*a, **k)
        captured["trajs"] = trajs
        return trajs, timing

    tr.rollout = rollout
    if side in ("actor", "both"):
        oracle = OracleExtractor(rules)
        tr.track.generate = oracle
        if prefill:  # one true lesson per family before step 0: every guided episode can find its family's
            for family, code in rules.items():
                tr.track.mgr.apply_output(
                    ENV,
                    lesson_op(family, code),
                    [],
                    step=-1,
                    prompt="oracle prefill",
                    query=f"Open the {family}.",
                )
    else:
        generate = tr.track.generate

        def recorded(prompts, key, version=None):
            got = generate(prompts, key, version)
            captured["lessons"] += [(p, g.text) for p, g in zip(prompts, got, strict=True)]
            return got

        tr.track.generate = recorded
    rows = []
    rewards: list[float] = []
    t_start = time.perf_counter()
    try:
        for _ in range(steps):
            captured["lessons"] = []
            m = tr.train_step()
            guided = [t for t in captured["trajs"] if t.spec.guided and not t.infra_failed]
            row = {
                "bench": "experience_matters_step",
                "side": side,
                "seed": seed,
                "step": tr.step - 1,
                "guided": m.get("success/guided"),
                "free": m.get("success/free"),
                "bank": m.get("bank/size"),
                "step_s": round(m.get("time/step_s", 0.0) or 0.0, 2),
            }
            fam = [str(t.goal).removeprefix("Open the ").split(" in the ")[0] for t in guided]
            hits = [f in t.spec.experience for f, t in zip(fam, guided, strict=True)]
            row["hit"] = _mean(hits)
            # guided episodes whose lesson is about their own family: what reading can win
            row["guided_hit"] = _mean([t.success for t, h in zip(guided, hits, strict=True) if h])
            if side in ("actor", "both"):
                follow = []
                for t in guided:
                    said = named_actions(block_lessons(t.spec.experience))
                    played = parse_answer(t.transcript[0][1]) if t.transcript else None
                    follow.append(bool(said) and played == said[0])
                row["follow"] = _mean(follow)
                row["lessons_written"] = oracle.written
            else:
                right, named = [], []
                for prompt, text in captured["lessons"]:
                    family = family_of(prompt)
                    if family is None:
                        continue  # a merge call
                    said = named_actions(" ".join(lesson_texts(text)))
                    named.append(bool(said))
                    right.append(bool(said) and said[0] == rules[family][0])
                row["right"] = _mean(right)
                row["named"] = _mean(named)
                row["lessons"] = len(right)
                if "extractor/reward_mean" in m:
                    rewards.append(float(m["extractor/reward_mean"]))
                row["reward_mean"] = m.get("extractor/reward_mean")
                row["extractor_updates"] = tr.track.version
            rows.append(row)
            log(json.dumps(row))
    finally:
        tr.close()
    half = steps // 2
    keys = ("guided", "free", "hit", "guided_hit")
    keys += ("follow",) if side in ("actor", "both") else ("right", "named", "reward_mean")
    summary = {"bench": "experience_matters", "side": side, "seed": seed, "steps": steps}
    for k in keys:
        summary[f"{k}_first_half"] = _mean([r.get(k) for r in rows[:half]])
        summary[f"{k}_second_half"] = _mean([r.get(k) for r in rows[half:]])
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    log(json.dumps(summary))
    return {"rows": rows, "summary": summary}


def _last_experience_dir(run_dir: str) -> str:
    root = os.path.join(run_dir, "experience")
    steps = (
        sorted((int(d) for d in os.listdir(root) if d.isdigit()), reverse=True) if os.path.isdir(root) else []
    )
    if not steps:
        raise FileNotFoundError(
            f"no saved experience under {root!r}: is {run_dir!r} a finished run of a method with experience?"
        )
    return os.path.join(root, str(steps[0]))


def audit_run(run_dir: str) -> dict:
    """The lessons a run's extractor added (``add`` ops of distillation calls in the op log of its last saved
    experience): per outcome of the source episode and per half of the steps, the share naming any action
    (``named``), the share whose first named action is the family's rule (``right``) and the share naming the
    family (colour and kind anywhere in it: ``family``). The rules are those of the run's seed (``config.json``)."""
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    rules = hr.rules(int(cfg["seed"]))  # the trainer passes config.seed as rule_seed (EnvSpec.run_seed_kwarg)
    lessons = []
    with open(os.path.join(_last_experience_dir(run_dir), "oplog.jsonl")) as f:
        for line in f:
            op = json.loads(line)
            if op.get("op") != "add" or op.get("kind", "distill") != "distill" or "prompt" not in op:
                continue
            family = family_of(op["prompt"])
            if family is None:
                continue
            said = named_actions(format_entry(op["text"]))
            lessons.append(
                {
                    "step": int(op["step"]),
                    "success": "Outcome: SUCCESS" in op["prompt"],
                    "named": bool(said),
                    "right": bool(said) and said[0] == rules[family][0],
                    # colour and kind anywhere (a tiny extractor glues words; "red door" rarely survives intact)
                    "family": all(w in format_entry(op["text"]).lower() for w in family.split()),
                }
            )
    steps = int(cfg["train"]["steps"])
    out = {"bench": "lesson_audit", "run": os.path.basename(os.path.normpath(run_dir)), "seed": cfg["seed"]}
    out["lessons"] = len(lessons)
    for outcome, want in (("after_success", True), ("after_failure", False)):
        for half, lo, hi in (("first_half", 0, steps // 2), ("second_half", steps // 2, steps)):
            sel = [x for x in lessons if x["success"] == want and lo <= x["step"] < hi]
            out[f"{outcome}_{half}_n"] = len(sel)
            for k in ("named", "right", "family"):
                out[f"{outcome}_{half}_{k}"] = round(_mean([x[k] for x in sel]), 4) if sel else None
    return out


_AUDIT = flags.DEFINE_string(
    "audit", "", "glob of finished run directories: print their lesson audit and exit"
)
_SIDE = flags.DEFINE_enum(
    "side",
    "actor",
    ["actor", "extractor", "both"],
    "which side trains (the other is scripted); both: both scripted",
)
_SEEDS = flags.DEFINE_list("seeds", ["0"], "run seeds (each draws its own rules)")
_STEPS = flags.DEFINE_integer("steps", 12, "training steps per run")
_ROOT = flags.DEFINE_string("runs_dir", "runs/experience_matters", "run directories go under here")
_SET = flags.DEFINE_multi_string("set", [], "config overrides KEY=JSON, e.g. --set=rollout.group_size=8")
_PREFILL = flags.DEFINE_boolean(
    "prefill", False, "actor side: the bank starts with one true lesson per family"
)
_SCALE = flags.DEFINE_enum("scale", "cpu", ["cpu", "smollm"], "model scale of configs/hidden_rule.py")


def main(argv):
    del argv
    if _AUDIT.value:
        import glob

        # a glob over a comparison's root also matches the baseline's runs, which have no experience: skipped
        dirs = sorted(d for d in glob.glob(_AUDIT.value) if os.path.isdir(os.path.join(d, "experience")))
        if not dirs:
            raise SystemExit(f"--audit={_AUDIT.value!r} matches no run directory with saved experience")
        for d in dirs:
            print(json.dumps(audit_run(d)))
        return
    for seed in _SEEDS.value:
        workdir = os.path.join(_ROOT.value, f"{_SIDE.value}_{_SCALE.value}_s{seed}")
        run(
            _SIDE.value,
            int(seed),
            _STEPS.value,
            workdir,
            _SET.value,
            scale=_SCALE.value,
            prefill=_PREFILL.value,
        )


if __name__ == "__main__":
    app.run(main)
