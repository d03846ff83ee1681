"""Single task, SWE: repository repair with the paper's tools (execute_bash, str_replace_editor, submit).

The paper trains on SWE-Bench Verified (124 tasks filtered by pass@16 of Qwen3-4B, actor Qwen3-4B-Instruct-2507) in
per-task containers. Here the env is ``comprl/SWE-Lite-v0`` (``comprl_jax/envs/swe/``): procedural bugs in 9 pinned
pure-Python PyPI projects, each task validated by its tests, run offline in a bubblewrap sandbox; the reward on
submit is 1 iff the task's hidden tests pass (WORKSPACE "SWE-Lite"). Held-out evaluation plays the 3 projects never
seen in training (split ``eval``) and, as a second figure, held-out tasks of the training projects
(``same_project_eval``). 30 turns of up to 4,096 tokens in a 32,768-token context (SPEC §9).

Launch:
  python launch/train.py --config=configs/swebench.py --workdir=runs/swe              # paper scale (accelerators)
  python launch/train.py --config=configs/swebench.py:smollm --workdir=runs/swe_smol  # SmolLM2-135M on a CPU or GPU
  python launch/train.py --config=configs/swebench.py:tiny --workdir=runs/swe_tiny    # tiny random models (the suite)
Baselines: append `,baseline` (and the other methods of configs/minihack_room.py).

SWE-Bench Verified itself needs its per-task images under docker or podman: ``comprl_jax/envs/swe/bench.py``
(``SWEBenchEnv``) plays SWE-bench records with the same tools there, or on bubblewrap over local checkouts; its
docstring shows the ``register(...)`` call that makes it a training env (the container runtime is untested here: no
image can be pulled on this machine).
"""

from comprl_jax.config import apply_tasks, build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        apply_tasks(c, ("comprl/SWE-Lite-v0",))  # 30 turns / 4,096 tokens / 32,768 context, thread pool
        c.actor.model = "Qwen/Qwen3-4B-Instruct-2507"  # the paper's SWE actor (small scales replace it)

    return build(arg, "swebench", edit)
