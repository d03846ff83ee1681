"""`make demo`: Complementary RL on MiniHack Room (Ultimate 5x5) with tiny models on this CPU.

  python launch/demo.py --workdir=runs/demo [--steps=20]

Trains the `configs/minihack_room.py:tiny` config (tiny random-init actor and extractor, constrained actions and
ops, a MiniLM retriever over the experience bank) for a fixed number of steps, evaluates on held-out levels with
and without test-time experience, and prints where the metrics, TensorBoard logs, checkpoints and the plot are.
Re-running resumes from runs/demo (delete it, or `make clean`, to start over).

What to expect: tiny random-init models do not learn Room-Ultimate in minutes (its random-policy success is about
0.45 at 30 turns, lower at the tiny config's 10 turns); the demo shows the whole pipeline running end to end --
rollouts, retrieval, distillation into the bank, merges, actor and extractor updates, checkpoints -- not the
paper's effect, which needs a pretrained model (`:smollm`, ideally on a GPU).
"""

import os
import time

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "run directory")
_STEPS = flags.DEFINE_integer("steps", 20, "training steps")


def main(argv):
    del argv
    t0 = time.time()
    import importlib.util

    from comprl_jax import trainer

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "minihack_room", os.path.join(repo, "configs", "minihack_room.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = mod.get_config("tiny")
    config.train.steps = _STEPS.value
    config.train.eval_tasks = 4
    workdir = os.path.abspath(_WORKDIR.value)
    print(
        f"[demo] Complementary RL, {config.env.tasks[0]}, tiny models, {config.train.steps} steps -> {workdir}"
    )
    out = trainer.run(config, workdir)
    last = out["last_metrics"]
    print(f"\n[demo] done in {(time.time() - t0) / 60:.1f} min")
    print(
        f"[demo] last step: success {last.get('success', float('nan')):.3f} "
        f"(guided {last.get('success/guided', float('nan')):.3f}, free {last.get('success/free', float('nan')):.3f}), "
        f"actions/episode {last.get('actions_per_episode', float('nan')):.2f}, "
        f"bank size {int(last.get('bank/size', 0))}"
    )
    if "eval" in out:
        print(f"[demo] held-out eval: {out['eval']}")
    print(f"[demo] metrics:     {os.path.join(workdir, 'metrics.jsonl')}")
    print(f"[demo] tensorboard: tensorboard --logdir {os.path.join(workdir, 'tb')}")
    print(f"[demo] checkpoints: {os.path.join(workdir, 'checkpoints')}")
    print(f"[demo] plot:        {os.path.join(workdir, 'curves.png')}")


if __name__ == "__main__":
    app.run(main)
