"""HiddenRule (issue 31): a task family where experience can matter; not one of the paper's environments.

16 families of locked objects (colour x kind, named by the goal); each opens with its own secret action of 8, drawn
from the run's seed (``--config.seed``) and the same for every instance of the family; a wrong action ends the
episode (one action per episode). A lesson from one solved instance holds for its whole family; an outcome-only
policy must learn the 16 rules into its weights. Held-out evaluation plays new place names in the same families.
Uniform random success 0.125, a policy that knows the rules 1.0 (``comprl_jax/envs/hidden_rule.py``; WORKSPACE
"HiddenRule: can experience matter?").

Launch (tiny random-init models on 2 CPU cores; ~2 s a step for the baseline):
  python launch/train.py --config=configs/hidden_rule.py:cpu --workdir=runs/hidden_rule
  -> one progress line per step (success/guided vs success/free); metrics.jsonl, curves.png
Baselines: append `,baseline`, `,static_online`, `,blank_exp` (the comparison: launch/bench/compare_cpu.sh with
CONFIG=configs/hidden_rule.py:cpu). SmolLM2-135M-Instruct as actor and extractor: `:smollm` (4 tasks x 8 episodes,
the top 4 layers train, as WORKSPACE "SmolLM2 on this CPU"). Each side with the other scripted:
launch/bench/experience_matters.py.

Sizes: `:cpu` plays 8 tasks x 8 episodes a step (Room's `:cpu` plays 2 x 16): with 16 families, 2 tasks a step
would take 8 steps to show the bank each family once; episodes are one action, so 64 of them cost little. The
actor's learning rate is `:tiny`'s 1e-3 with one optimizer step per batch: at `:cpu`'s 3e-3 and two steps the tiny
actor collapsed onto one action for every family within 20 steps (success = the share of families that action
opens).
"""

from comprl_jax.config import apply_tasks, build

# attempts per episode -> env id: a wrong action ends the episode, or (3) resets the lock with feedback
ENVS = {"1": "comprl/HiddenRule-v0", "3": "comprl/HiddenRule-3Tries-v0"}


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        attempts = extras.get("attempts", "1")
        if attempts not in ENVS:
            raise ValueError(f"config variant attempts={attempts!r}: use attempts=1 or attempts=3")
        apply_tasks(c, (ENVS[attempts],))  # 4 turns (the registry's limit), 128 steps

    def after_scale(c, scale):
        if scale == "cpu":
            c.rollout.tasks_per_step = 8
            c.rollout.group_size = 8
            c.actor.lr = 1e-3
            c.actor.updates_per_batch = 1
        elif scale == "warm":
            # The shipped warm-start models (issue 49): they read and write lessons before RL starts. 8 tasks x 8
            # episodes a step as :cpu; a smaller step than :cpu's 1e-3 for models whose skills the update must
            # keep; held-out evaluation over 16 tasks x 4 episodes per mode. The extractor's 3e-5: at 3e-4 its
            # CISPO update took the early extractor's right lessons from 0.36 to 0.09 in 30 steps (the full one's
            # from 0.99 to 0.13 under blank experience); at 3e-5 they held, 0.46 -> 0.47 (WORKSPACE, issue 49).
            c.rollout.tasks_per_step = 8
            c.rollout.group_size = 8
            c.actor.lr = 3e-4
            c.extractor.lr = 3e-5
            c.actor.updates_per_batch = 1
            c.train.eval_tasks = 16
        elif scale == "smollm":
            c.rollout.tasks_per_step = 4
            c.rollout.group_size = 8
            c.actor.trainable_layers = 4
            c.actor.lr = 3e-4

    return build(arg, "hidden_rule", edit, after_scale)
