"""Single task: SWE-Bench Verified (124 filtered tasks; actor Qwen3-4B-Instruct-2507).

NOT runnable here: it needs a container sandbox per task (tools execute_bash, str_replace_editor, submit) that
this project does not ship; see WORKSPACE.md "SWE-Bench". The config records the paper's setting so that a
sandboxed env registered as `comprl/SWEBench-Verified-v0` can be dropped in.
Launch (once such an env exists): python launch/train.py --config=configs/swebench.py --workdir=runs/swe
"""

from comprl_jax.config import build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        c.env.tasks = ("comprl/SWEBench-Verified-v0",)
        c.actor.model = "Qwen/Qwen3-4B-Instruct-2507"
        c.env.backend = "process"
        c.env.max_turns = 30

    return build(arg, "swebench", edit)
