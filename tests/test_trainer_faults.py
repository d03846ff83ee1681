"""Faults during a run (issue 7): env steps that raise, an env that hangs past the step timeout, and malformed
extractor output are counted and survived; the run completes."""

import json
import time

import pytest
from trainer_helpers import load_config

from comprl_jax.envs import registry
from comprl_jax.envs.sokoban_env import SokobanTextEnv

pytestmark = pytest.mark.slow
CLEAR_JAX_CACHES_EACH_TEST = True  # see conftest.py: each test compiles its own Trainer's programs


class FaultySokoban(SokobanTextEnv):
    """Real Sokoban whose ``step`` raises 20% of the time and hangs (5 s) on the first step of every third
    episode of an instance."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._episodes = 0
        self._fault_rng = None

    def _reset(self, seed):
        import random

        self._episodes += 1
        self._fault_rng = random.Random(seed)
        self._first = True
        return super()._reset(seed)

    def _step(self, action):
        if self._first and self._episodes % 3 == 0:
            time.sleep(5.0)
        self._first = False
        if self._fault_rng.random() < 0.2:
            raise RuntimeError("injected env fault")
        return super()._step(action)


def test_run_survives_env_faults_and_malformed_extractor_output(tmp_path):
    registry.register("test/FaultySokoban-v0", f"{__name__}:FaultySokoban", dim=6, num_boxes=2)
    from comprl_jax.loop import run as run_lib

    c = load_config(
        "minihack_room",
        "tiny",
        **{
            "train.steps": 3,
            "rollout.tasks_per_step": 2,
            "env.step_timeout_s": 1.0,
            "env.max_turns": 4,
            # Unconstrained tiny extractor: its output is random text, i.e. malformed ops.
            "extractor.constrained": False,
            "extractor.sampling.max_new_tokens": 32,
        },
    )
    c.env.tasks = ("test/FaultySokoban-v0",)
    out = run_lib.run(c, str(tmp_path), progress=False)
    assert out["step"] == 3
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Raises and the timeout were recorded as infrastructure failures, not fatal, and not agent failures.
    assert sum(r["episodes_failed_infra"] for r in rows) > 0
    ev = out["eval"]["without_exp"]["test/FaultySokoban-v0"]
    total = c.train.eval_tasks * (c.rollout.group_size // 2)
    assert ev["infra_failed"] > 0 and ev["episodes"] + ev["infra_failed"] == total
    assert ev["split"] == "held-out seeds"
    last = rows[-1]
    rejected = last.get("bank/ops_rejected", 0)
    assert rejected > 0 and last["bank/ops_submitted"] == (
        last.get("bank/ops_applied", 0) + last.get("bank/ops_returned", 0) + rejected
    )


def test_search_and_ask_in_guided_rollouts(tmp_path):
    """A guided episode's <knowledge_search_and_ask> is answered by the extractor as a tool turn (at most twice
    per episode, never for free episodes), and the refinement becomes an extractor sample rewarded by the outcome."""
    import jax

    from comprl_jax.loop.trainer import Trainer

    c = load_config(
        "minihack_room",
        "tiny",
        **{"retrieval.search_and_ask": True, "env.max_turns": 4, "actor.sampling.max_new_tokens": 96},
    )
    tr = Trainer(c, str(tmp_path))
    try:
        ask = "<knowledge_search_and_ask>where are the stairs</knowledge_search_and_ask>"
        forced = tr.actor.sampler.strings_constraint((ask, "<answer>east</answer>"))
        tr._constraint = lambda env_id, can_ask=False: forced
        # Random tiny actor: over 4 episodes x 4 turns both branches are taken; rerun seeds until an ask happens.
        for seed in range(5):
            trajs, _ = tr.rollout(tr.tasks.next(), guided_ok=True, step=0, key=jax.random.key(seed))
            if any(t.ask_keys for t in trajs):
                break
        assert any(t.ask_keys for t in trajs if t.spec.guided)
        assert all(not t.ask_keys for t in trajs if not t.spec.guided)
        assert all(len(t.ask_keys) <= c.retrieval.search_and_ask_max for t in trajs)
        for t in trajs:
            text = tr.actor.model.tokenizer.decode(t.tokens)
            # The guided system prompt describes the tool; free episodes never hear of it.
            assert ("knowledge_search_and_ask>your question" in text) == t.spec.guided
            if t.ask_keys:  # the tool answer is in the context, with mask 0 (not the actor's tokens)
                assert "<tool_response>" in text
                # ... and in the transcript the extractor distils (the question, then the answer)
                lines = t.transcript_text(10_000)
                assert "<knowledge_search_and_ask>" in lines and "[search & ask answer]" in lines
                # Tool turns do not use up env turns: an episode that did not end early took all its actions.
                if not t.success and not t.context_full and not t.infra_failed:
                    assert t.turns == c.env.max_turns and t.asks == len(t.ask_keys) >= 1
        tr.track.record_outcomes(trajs)
        keys = [k for t in trajs for k in t.ask_keys]
        assert all(k in tr.track.mgr.buffer.samples for k in keys)
    finally:
        tr.close()
