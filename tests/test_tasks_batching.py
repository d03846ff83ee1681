"""Task sampler determinism/resume and batch packing."""

import numpy as np
import pytest

from comprl_jax.roles.batching import bucket, pack
from comprl_jax.rollout.tasks import TaskSampler


def test_task_sampler_is_deterministic_and_resumable():
    a = TaskSampler(["x", "y"], tasks_per_step=3, seed=7)
    steps = [a.next() for _ in range(4)]
    assert [t.env_id for t in steps[0]] == ["x"] * 3 + ["y"] * 3
    assert [t.task_index for t in steps[0]] == [0, 0, 0, 1, 1, 1]
    b = TaskSampler(["x", "y"], tasks_per_step=3, seed=7)
    b.next(), b.next()
    c = TaskSampler(["x", "y"], tasks_per_step=3, seed=7)
    c.load_state_dict(b.state_dict())
    assert c.next() == steps[2] and c.next() == steps[3]
    ev = a.eval_tasks(5)
    assert all(t.seed >= TaskSampler.TRAIN_SEED_SPACE for t in ev)
    assert ev == TaskSampler(["x", "y"], 3, 7).eval_tasks(5)
    with pytest.raises(ValueError, match="env.tasks"):
        c.load_state_dict({**b.state_dict(), "env_ids": ["z"]})


def test_bucket_and_pack():
    assert bucket(1) == 64 and bucket(65) == 128 and bucket(128) == 128
    with pytest.raises(ValueError, match="max context"):
        bucket(300, maximum=256)
    out = pack([[5, 6, 7], [8]], [[0, 1, 1], [1]], pad_id=0, length=4, rows=3)
    np.testing.assert_array_equal(out["tokens"], [[5, 6, 7, 0], [8, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["loss_mask"], [[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["attn_mask"].sum(1), [3, 1, 0])
    np.testing.assert_array_equal(out["row_valid"], [True, True, False])
    with pytest.raises(ValueError, match="loss mask"):
        pack([[1, 2]], [[1]], pad_id=0)
