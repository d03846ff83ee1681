"""Shared helpers for trainer tests: minimal overrides that keep a `:tiny` run to seconds per step."""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Smallest settings that still exercise every part of a step (guided + free, distil, merge, extractor update).
MINI = {
    "rollout.tasks_per_step": 1,
    "rollout.group_size": 2,
    "env.max_turns": 3,
    "env.workers": 1,
    "train.steps": 2,
    "train.eval_tasks": 1,
    "extractor.buffer_size": 2,
    "actor.micro_batch": 1,
    "extractor.micro_batch": 1,
    "checkpoint.every": 1,
    "bank.merge_every": 1,
    "extractor.sampling.max_new_tokens": 128,
}


def load_config(name: str, variant: str = "tiny", **overrides):
    path = os.path.join(REPO, "configs", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"cfg_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config(variant)
    for key, value in {**MINI, **overrides}.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def flags(**overrides) -> list[str]:
    return [f"--config.{k}={v}" for k, v in {**MINI, **overrides}.items()]
