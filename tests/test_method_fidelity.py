"""Issue 13, the parts of the paper's method that must act: held-out evaluation splits, infrastructure failures
out of every statistic, exact sampled ids with behaviour log-probabilities for both roles (stale extractor samples
get an importance weight != 1), actor mini-batch steps, Eq. 7 with recency and the cooldown in extractor updates,
search & ask, self-distillation and actor-critic arithmetic, a shared multi-task bank, and every config key read."""

import ast
import dataclasses
import math
import os
import re
import threading
import time

import jax
import numpy as np
import pytest
from test_experience_helpers import DIM, FakeClock, add, answer, hash_embed, mem

from comprl_jax import config as config_lib
from comprl_jax.config.run import RunConfig
from comprl_jax.envs import registry
from comprl_jax.experience import BankConfig, BufferConfig, ExperienceManager, IndexConfig, RetrievalConfig
from comprl_jax.experience.buffer import ExtractorBatch
from comprl_jax.experience.retrieval import EmbedCache, diversify
from comprl_jax.experience.sample import Generation, decode_record
from comprl_jax.loop import evaluation
from comprl_jax.rl import subgroup_advantages
from comprl_jax.rollout.episodes import EpisodeSpec, Trajectory
from comprl_jax.rollout.tasks import Task, TaskSampler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- 1. held-out evaluation --------------------------------------------------------------------------------------


def _split_task_keys(env_id: str, split: str) -> set[str]:
    """Every task reachable from any seed on ``split`` (a seed picks ``seed % n`` of the split's list)."""
    env = registry.make(env_id, split=split, max_turns=5)
    try:
        if hasattr(env, "games"):  # ALFWorld: the game itself, wherever the split puts it
            return {"/".join(str(g).split(os.sep)[-3:-1]) for g in env.games}
        if hasattr(env, "tasks"):  # SWE-Lite: the bug (project, file, patch), whatever its id
            return {(t["project"], t["file"], t["patch"]) for t in env.tasks}
        return {g.key for g in env.goals}  # WebShop
    finally:
        env.close()


def test_training_and_evaluation_tasks_are_disjoint_for_every_registered_env():
    train_seeds = {t.seed for s in range(200) for t in _next(TaskSampler(("x",), 16, 0), s)}
    for env_id in registry.ENV_IDS:
        spec = registry.spec(env_id)
        splits = evaluation.splits_of(env_id)
        if spec.levels == "split":
            train = _split_task_keys(env_id, spec.train_split)
            assert len(splits) >= 1 and spec.train_split not in splits
            for split in splits:
                held_out = _split_task_keys(env_id, split)
                assert held_out and not (train & held_out), (env_id, split, sorted(train & held_out)[:3])
                # evaluation plays distinct tasks 0..n-1 of the split
                seeds = [t.seed for t in evaluation.eval_tasks(env_id, 0, split, 50, seed=0)]
                assert seeds == list(range(50))
        elif spec.levels == "seeded":  # the level is generated from the seed: seeds must not overlap
            assert splits == (None,) and evaluation.split_name(env_id, None) == evaluation.SEEDED_SPLIT
            held_out = {t.seed for t in evaluation.eval_tasks(env_id, 0, None, 500, seed=0)}
            assert len(held_out) == 500 and not (held_out & train_seeds)
            assert min(held_out) >= TaskSampler.TRAIN_SEED_SPACE > max(train_seeds)
        else:  # one fixed level: no held-out task exists, and the evaluation says so
            assert spec.levels == "fixed" and evaluation.split_name(env_id, None) == registry.FIXED_SPLIT
    # The labels: the env id for the primary figure, <env>@<split> for the second one.
    assert evaluation.label("comprl/ALFWorld-v0", "valid_unseen") == "comprl/ALFWorld-v0"
    assert evaluation.label("comprl/ALFWorld-v0", "valid_seen") == "comprl/ALFWorld-v0@valid_seen"
    assert evaluation.splits_of("comprl/ALFWorld-v0", "valid_seen") == ("valid_seen",)


def _next(sampler, step):
    sampler.step = step
    return sampler.next()


def test_fixed_level_env_really_has_one_level():
    env = registry.make("comprl/MiniHack-Room-5x5-v0", max_turns=5)
    try:
        assert len({env.reset(seed=s)[0] for s in (0, 7, 2**30 + 3)}) == 1
    finally:
        env.close()


def test_paper_scale_evaluation_plays_each_held_out_task_once():
    """train.eval_full_splits (the default): ALFWorld's 134 valid_unseen games and 140 valid_seen ones, WebShop's
    500 goals, whatever train.eval_tasks says; otherwise eval_tasks bounded by the split (no task twice)."""
    from comprl_jax.loop.evaluation import eval_tasks

    full = {
        s: eval_tasks("comprl/ALFWorld-v0", 0, s, 128, 0, full=True) for s in ("valid_unseen", "valid_seen")
    }
    assert [t.seed for t in full["valid_unseen"]] == list(range(134)) and len(full["valid_seen"]) == 140
    assert len(eval_tasks("comprl/WebShop-v0", 1, "eval", 128, 0, full=True)) == 500
    assert len(eval_tasks("comprl/ALFWorld-v0", 0, "valid_unseen", 200, 0)) == 134
    assert len(eval_tasks("comprl/WebShop-v0", 1, "eval", 8, 0)) == 8
    seeded = eval_tasks("comprl/MiniHack-Room-Ultimate-5x5-v0", 0, None, 16, 0, full=True)
    assert len(seeded) == 16 and len({t.seed for t in seeded}) == 16
    c = config_lib.load_file("configs/multitask3.py")
    assert (
        c.train.eval_full_splits
        and not config_lib.load_file("configs/multitask3.py:tiny").train.eval_full_splits
    )


def test_eval_pools_play_the_held_out_split():
    """Pools built with ``split=`` (what Trainer.eval_pools does) reset into the held-out games / goals."""
    from comprl_jax.rollout.pools import Pools

    unseen = _split_task_keys("comprl/ALFWorld-v0", "valid_unseen")
    pools = Pools(["comprl/ALFWorld-v0"], 1, 1, "thread", 5, 120.0, env_kwargs={"split": "valid_unseen"})
    try:
        _, info = pools.pools["comprl/ALFWorld-v0"].submit_reset(0, 3).result()
        assert info["task_id"].startswith("valid_unseen/")
        assert "/".join(info["task_id"].split("/")[1:]) in unseen
    finally:
        pools.close()
    goals = _split_task_keys("comprl/WebShop-v0", "eval")
    pools = Pools(["comprl/WebShop-v0"], 1, 1, "thread", 5, 60.0, env_kwargs={"split": "eval"})
    try:
        env_info = [pools.pools["comprl/WebShop-v0"].submit_reset(0, s).result()[1] for s in range(3)]
        assert all(i["task_id"] in goals for i in env_info), [i["task_id"] for i in env_info]
    finally:
        pools.close()


# ---- 3. infrastructure failures ----------------------------------------------------------------------------------


def _traj(
    success, guided, failed=False, tokens=(1, 2, 3, 4), mask=(0, 1, 1, 0), env="comprl/Sokoban-6x6-2-v0"
):
    spec = EpisodeSpec(
        Task(env, 0, 0), 0, guided, experience="E" if guided else "", entry_uids=(0,) if guided else ()
    )
    return Trajectory(
        spec=spec, tokens=list(tokens), loss_mask=list(mask), reward=float(success), success=success, turns=1,
        num_invalid=0, goal="g", query="q", transcript=[("o", "a")], final_obs="f",
        logprobs=[0.0, -0.5, -0.25, 0.0], infra_failed=failed,
    )  # fmt: skip


def test_infra_failures_are_out_of_the_advantages_and_the_batch():
    # One group of 4 free rollouts: rewards 1, 0, 0 and an infra failure (reward 0, but it says nothing).
    r = np.array([[1.0, 0.0, 0.0, 0.0]])
    sg = np.zeros((1, 4), np.int32)
    valid = np.array([[True, True, True, False]])
    adv = np.asarray(subgroup_advantages(r, sg, "mean_std", 1e-6, valid=valid))
    # cell = (1, 0, 0): mean 1/3, unbiased std sqrt(1/3); the failed rollout gets 0 and is not in the cell.
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    np.testing.assert_allclose(
        adv[0], [(2 / 3) / (std + 1e-6), -(1 / 3) / (std + 1e-6), -(1 / 3) / (std + 1e-6), 0.0], rtol=1e-5
    )
    from comprl_jax.roles.train_batches import actor_batch

    trajs = [_traj(True, False), _traj(False, False), _traj(False, False), _traj(False, False, failed=True)]
    batch = actor_batch(trajs, np.ones(4, np.float32), np.zeros(4, np.int32), pad_id=0)
    assert batch["loss_mask"][:3].sum() > 0 and batch["loss_mask"][3].sum() == 0  # no tokens, no advantage
    assert batch["advantages"][3] == 0.0
    np.testing.assert_array_equal(batch["tokens"][0, :4], [1, 2, 3, 4])  # the sampled ids, not re-encoded
    np.testing.assert_allclose(batch["behaviour_logprobs"][0, :4], [0.0, -0.5, -0.25, 0.0])


def test_infra_failed_episodes_give_no_extractor_reward_and_are_not_distilled():
    from comprl_jax.loop.extractor_track import ExtractorTrack

    m = ExperienceManager(hash_embed, DIM, None, clock=FakeClock())
    m.apply_output("t", answer(add(mem("a", "go east"))), [], step=0, prompt="P")
    track = ExtractorTrack.__new__(ExtractorTrack)  # only record_outcomes' state
    track.mgr = m
    track.record_outcomes([_traj(True, True, failed=True), _traj(False, True)])
    assert m.buffer.samples["call:0"].count == 1 and m.buffer.samples["call:0"].reward == -1.0


# ---- 4. off-policy correctness -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny tokenizer and config (the trainer's :tiny settings)."""
    from comprl_jax.models.zoo import tiny_tokenizer

    c = config_lib.build("tiny", "t")
    corpus = ["Observation: go north east south west"] * 10 + ["lesson " + str(i) for i in range(50)]
    return tiny_tokenizer(corpus, str(tmp_path_factory.mktemp("tok"))), c


def _role(tiny, name, loss, rows, lr):
    from comprl_jax.models.zoo import load_model
    from comprl_jax.roles import role as roles

    tok, c = tiny
    section = dataclasses.replace(getattr(RunConfig.of(c), name), lr=lr, micro_batch=1)
    return roles.build_role(load_model("tiny", role=name, tokenizer=tok, seed=3), name, section, loss, rows)


def test_stale_extractor_sample_gets_a_clipped_importance_weight(tiny):
    """A sample written by the extractor before k updates trains against its writer's logprobs: rho != 1 and is
    clipped at 1 +- eps. (Recomputing old logprobs with the current weights, as before, gives rho = 1 exactly.)"""
    from comprl_jax.rl import ExtractorLossConfig
    from comprl_jax.roles import role as roles
    from comprl_jax.roles.train_batches import extractor_batch
    from comprl_jax.sampling import SamplingParams

    tok, _ = tiny
    role = _role(tiny, "extractor", ExtractorLossConfig(clip_eps=0.1), rows=2, lr=3e-2)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)[0]
               for p in ("lesson 1", "lesson 2")]  # fmt: skip
    res = role.sampler.generate(prompts, jax.random.key(0), SamplingParams(max_new_tokens=12))
    gens = [
        Generation(tok.decode(res.tokens[b, : res.lengths[b]].tolist()), tuple(prompts[b]),
                   tuple(res.tokens[b, : res.lengths[b]].tolist()), tuple(res.logprobs[b, : res.lengths[b]]), 0)
        for b in range(2)
    ]  # fmt: skip
    xb = ExtractorBatch(["call:0", "call:1"], ["lesson 1", "lesson 2"], [g.text for g in gens],
                        np.array([1.0, -1.0]), np.ones(2, np.float32), 0, [g.record() for g in gens])  # fmt: skip
    batch, host = extractor_batch(xb, tok, version=0)
    np.testing.assert_array_equal(batch["tokens"][0, : len(prompts[0]) + len(gens[0].response_ids)],
                                  list(prompts[0]) + list(gens[0].response_ids))  # fmt: skip
    fresh = jax.device_get(roles.dispatch_update(role, batch))
    assert fresh["is_weight"] == pytest.approx(1.0, abs=1e-5) and fresh["logprob_mismatch"] < 1e-5
    for _ in range(3):  # the extractor moves on
        roles.dispatch_update(role, batch)
    stale_batch, host = extractor_batch(xb, tok, version=4)
    assert host["staleness_mean"] == 4.0
    stale = jax.device_get(roles.dispatch_update(role, stale_batch))
    assert abs(stale["ratio"] - 1.0) > 1e-3 and stale["clipfrac"] > 0  # rho moved and the clip acts
    assert stale["ratio_max"] > 1.1 and stale["is_weight_max"] == pytest.approx(1.1)  # clipped at 1 + eps
    recomputed = dict(stale_batch, use_behaviour=np.zeros(2, bool))
    assert jax.device_get(roles.dispatch_update(role, recomputed))["ratio"] == pytest.approx(1.0, abs=1e-6)
    # A deferred refresh (the trainer's extractor updates): the sampler answers with the weights before the update,
    # even where it reads the training state itself (this f32 one-device layout), which the update donates.
    assert role.layout.same
    sp = SamplingParams(max_new_tokens=12, greedy=True)
    before = role.sampler.generate(prompts, jax.random.key(0), sp)
    for _ in range(2):
        roles.dispatch_update(role, batch, refresh=False)
    during = role.sampler.generate(prompts, jax.random.key(0), sp)
    np.testing.assert_array_equal(during.logprobs, before.logprobs)
    assert role.apply_refresh() and not role.apply_refresh()
    after = role.sampler.generate(prompts, jax.random.key(0), sp)
    assert np.abs(after.logprobs - before.logprobs).max() > 1e-3  # now the updated weights


def test_actor_mini_batch_steps_move_the_ratio_and_mismatch_is_tiny(tiny):
    from comprl_jax.rl import ActorLossConfig
    from comprl_jax.roles import batching
    from comprl_jax.roles import role as roles
    from comprl_jax.sampling import SamplingParams

    tok, _ = tiny
    role = _role(tiny, "actor", ActorLossConfig(), rows=2, lr=3e-2)  # 4 rows = 2 optimizer steps
    prompts = [tok.encode(f"Observation: go {d}") for d in ("north", "south", "east", "west")]
    res = role.sampler.generate(prompts, jax.random.key(1), SamplingParams(max_new_tokens=8))
    seqs, masks, lps = [], [], []
    for b, p in enumerate(prompts):
        n = int(res.lengths[b])
        seqs.append(p + res.tokens[b, :n].tolist())
        masks.append([0] * len(p) + [1] * n)
        lps.append([0.0] * len(p) + res.logprobs[b, :n].tolist())
    batch = batching.pack(seqs, masks, tok.pad_id, logprobs=lps)
    batch.pop("row_valid")
    batch["advantages"] = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
    batch["subgroup"] = np.zeros(4, np.int32)
    batch["behaviour_mask"] = batch["loss_mask"]
    m = jax.device_get(roles.dispatch_update(role, batch))
    assert m["step"] == 2.0  # two optimizer steps from one rollout batch
    assert m["logprob_mismatch"] < 1e-5  # sampler vs trainer, same weights, float32
    assert m["ratio_max"] > 1.0 + 1e-3 and m["clipfrac"] > 0  # the second mini-batch is off-policy


def test_one_step_shortcut_only_takes_samples_of_the_current_weights(tiny):
    """One optimizer step per batch takes pi_old from the update's own forward pass (rho = 1): right only for the
    current weights' samples. A batch that does not say, or says older weights, is refused (an asynchronous actor
    would otherwise lose its importance correction silently)."""
    from comprl_jax.rl import ActorLossConfig
    from comprl_jax.roles import role as roles
    from comprl_jax.roles.train_batches import actor_batch

    tok, _ = tiny
    role = _role(tiny, "actor", ActorLossConfig(), rows=4, lr=3e-2)
    trajs = [_traj(i % 2 == 0, i < 2) for i in range(4)]
    batch = actor_batch(trajs, np.array([1.0, -1.0, 1.0, -1.0], np.float32), np.zeros(4, np.int32), pad_id=0)
    with pytest.raises(ValueError, match="sampled by weights version None"):
        roles.dispatch_update(role, batch)
    fresh = actor_batch(trajs, np.array([1.0, -1.0, 1.0, -1.0], np.float32), np.zeros(4, np.int32), pad_id=0,
                        sampled_by=role.version)  # fmt: skip
    m = jax.device_get(roles.dispatch_update(role, fresh))
    assert role.version == 1 and m["ratio"] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="version 0 but the actor is at version 1"):
        roles.dispatch_update(role, fresh)  # the same samples again: the weights that sampled them are gone


def _generating_track(c, sampler, tok, version: int):
    """An ExtractorTrack with only what ``generate`` reads (no manager, no pools, unconstrained)."""
    from comprl_jax.loop.extractor_track import ExtractorTrack

    track = ExtractorTrack.__new__(ExtractorTrack)
    track.cfg, track.sampler, track.tokenizer = RunConfig.of(c).extractor, sampler, tok
    track.version = track.sampler_version = version
    track._constraint = None
    track.sp = track.cfg.sampling
    return track


def test_extractor_generation_records_the_truncated_prompt_it_sampled(tiny):
    """The extractor sees a left-truncated prompt when it is too long; the record (and so the update) holds
    exactly those ids."""
    tok, c = tiny
    c = c.copy_and_resolve_references()
    with c.unlocked():
        c.extractor.max_context = 96
        c.extractor.sampling.max_new_tokens = 16
    from comprl_jax.rl import ExtractorLossConfig

    role = _role(tiny, "extractor", ExtractorLossConfig(), rows=2, lr=1e-3)
    track = _generating_track(c, role.sampler, tok, version=5)
    long = "lesson " * 200
    (g,) = track.generate([long], jax.random.key(0))
    full = tok.apply_chat_template([{"role": "user", "content": long}], add_generation_prompt=True)[0]
    assert len(g.prompt_ids) == 96 - 16 and list(g.prompt_ids) == full[-80:]
    s = decode_record(g.record())
    assert s.ids == list(g.prompt_ids) + list(g.response_ids) and s.version == 5
    assert s.logprobs[80:] == pytest.approx(list(g.logprobs))


def test_extractor_rows_per_call_bounds_each_sampler_call(tiny):
    """extractor.rows_per_call (issue 19: the :smollm distillation cache beside the actor update): 5 prompts at 2
    per call are 3 sampler calls of 2, 2, 1 rows on keys fold_in(key, i), in prompt order; 0 = one call on key."""
    from comprl_jax.rl import ExtractorLossConfig

    tok, c = tiny
    role = _role(tiny, "extractor", ExtractorLossConfig(), rows=2, lr=1e-3)
    prompts = [f"lesson {i} " * (i + 1) for i in range(5)]
    key = jax.random.key(3)
    got = {}
    for per in (0, 2):
        cc = c.copy_and_resolve_references()
        with cc.unlocked():
            cc.extractor.sampling.max_new_tokens = 8
            cc.extractor.rows_per_call = per
        calls = []

        class Spy:
            def __init__(self, log):
                self.log = log

            def generate(self, ids, k, *a, **kw):
                self.log.append((len(ids), k))
                return role.sampler.generate(ids, k, *a, **kw)

        track = _generating_track(cc, Spy(calls), tok, version=0)
        got[per] = track.generate(prompts, key)
        assert len(got[per]) == 5
        for g, p in zip(got[per], prompts, strict=True):
            assert list(g.prompt_ids) == tok.encode_user_prompt(p)
        if per == 0:
            assert [n for n, _ in calls] == [5] and calls[0][1] is key
        else:
            assert [n for n, _ in calls] == [2, 2, 1]
            for i, (_, k) in enumerate(calls):
                assert (jax.random.key_data(k) == jax.random.key_data(jax.random.fold_in(key, i))).all()
    # the chunked call's row 4 is the third call's only row: the same as sampling it alone on fold_in(key, 2)
    alone = role.sampler.generate(
        [tok.encode_user_prompt(prompts[4])],
        jax.random.fold_in(key, 2),
        track.sp,
        stop_strings=("</answer>",),
    )
    assert list(got[2][4].response_ids) == alone.tokens[0, : alone.lengths[0]].tolist()


# ---- 5. extractor buffer -----------------------------------------------------------------------------------------


def test_every_full_buffer_batch_is_popped_and_counted_in_updates():
    m = ExperienceManager(hash_embed, DIM, None, buffer_cfg=BufferConfig(batch_size=2), clock=FakeClock())  # fmt: skip
    for i in range(5):
        m.apply_output("t", answer(add(mem(f"a{i}", f"go {i}"))), [], step=0, prompt="P")
        m.record_outcome([i], i % 2 == 0)
    popped = []
    while (b := m.pop_extractor_batch(len(popped))) is not None:
        m.mark_trained(b, len(popped))
        popped.append(b)
    assert len(popped) == 2 and len(m.buffer) == 1  # 5 samples -> two batches of 2, one waits
    assert [e.last_trained for e in m.bank.entries.values()] == [0, 0, 1, 1, None]


# ---- 6/7/8. search & ask, config keys, options --------------------------------------------------------------------


def test_embed_cache_runs_at_most_embed_workers_calls_at_once():
    live, peak, lock = [0], [0], threading.Lock()

    def slow(texts):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return hash_embed(texts)

    for workers in (1, 3):
        peak[0] = 0
        cache = EmbedCache(slow, workers=workers)
        threads = [threading.Thread(target=cache, args=([f"q{workers}-{i}"],)) for i in range(6)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert peak[0] == workers


def test_actor_critic_decisions_and_the_s_plus_r_reward():
    from comprl_jax.roles import actor_critic as ac

    assert ac.parse_decision("<think>x</think><answer>accept</answer>") == ac.Decision("accept")
    assert ac.parse_decision("<answer>reject</answer>").score == 0.0
    d = ac.parse_decision("<answer>refine:  go east,  then south</answer>")
    assert d == ac.Decision("refine", "go east, then south") and d.score == 0.5
    assert ac.parse_decision("garbage").verdict == "accept"  # unparsable: the entry is used as retrieved
    assert "go east, then south" in d.experience("BLOCK") and ac.Decision("accept").experience("B") == "B"
    assert "[No experience found]" in ac.Decision("reject").experience("B")
    assert re.fullmatch(ac.DECISION_REGEX, "<answer>refine: go east</answer>")
    # Extractor reward of an entry = mean over its episodes of (s + r), r only from episodes it guided: accepted
    # success 1 + 1, refined failure 0.5 - 1, rejected (the episode ran without it) success 0 + nothing
    # -> (2 - 0.5 + 0) / 3, through the track as the trainer calls it.
    from comprl_jax.loop.extractor_track import ExtractorTrack

    m = ExperienceManager(hash_embed, DIM, None, clock=FakeClock())
    m.apply_output("t", answer(add(mem("a", "go east"))), [], step=0, prompt="P")
    track = ExtractorTrack.__new__(ExtractorTrack)  # only record_outcomes' state
    track.mgr = m
    trajs = [_traj(True, True), _traj(False, True), _traj(True, True)]
    for t, d in zip(trajs, ["accept", "refine", "reject"], strict=True):
        t.spec.critic_score = ac.Decision(d).score
    track.record_outcomes(trajs)
    assert m.buffer.samples["call:0"].reward == pytest.approx(1.5 / 3)


def test_self_distillation_rows_strip_the_experience_and_keep_the_turns(tiny):
    """SPEC §7: all experience leaves the SFT row: the experience block, the search & ask tool description, and
    each search & ask exchange (question turn + the extractor's answer), built here by the engines' own helper."""
    from comprl_jax.rl import self_distillation_select
    from comprl_jax.roles.train_batches import strip_experience
    from comprl_jax.rollout.episodes import Episode, next_input, system_message
    from comprl_jax.rollout.search_ask import SearchAsk, search_ask_prompt

    tok, _ = tiny
    im_end = tok.special_ids.get("<|im_end|>")
    base, exp = "You play a game.", "Experience from earlier episodes\n1. go east: it works"
    tool = search_ask_prompt(2)
    msgs = [
        {"role": "system", "content": system_message(base, exp, tool)},
        {"role": "user", "content": "Observation: x"},
    ]
    ids, _ = tok.apply_chat_template(msgs, add_generation_prompt=True)
    question = tok.encode("<knowledge_search_and_ask>where</knowledge_search_and_ask>")
    reply = tok.encode("<answer>east</answer>")
    t = _traj(True, True, tokens=ids + question, mask=[0] * len(ids) + [1] * len(question))
    t.spec.experience = exp
    e = Episode(t.spec, {}, "x", [], True, False, None)
    SearchAsk.answer(e, "ask", "go east", "refine:0", t.tokens, len(question), tok, im_end)
    t.tokens += e.pending + reply
    t.loss_mask += [0] * len(e.pending) + [1] * len(reply)
    t.ask_spans = e.ask_spans
    after = next_input(t.tokens, {"role": "user", "content": "Observation: y"}, tok, im_end)
    t.tokens += after + reply
    t.loss_mask += [0] * len(after) + [1] * len(reply)
    got_ids, got_mask = strip_experience(t, tok, base, tool)
    plain, _ = tok.apply_chat_template(
        [{"role": "system", "content": base}, {"role": "user", "content": "Observation: x"}],
        add_generation_prompt=True,
    )
    # The row reads as if the actor had answered right away: system, x, east, y, east.
    assert got_ids == plain + reply + after + reply
    assert got_mask == [0] * len(plain) + [1] * len(reply) + [0] * len(after) + [1] * len(reply)
    text = tok.decode(got_ids)
    assert "search_and_ask" not in text and "go east" not in text and "Tool:" not in text
    # Selection: guided rollouts above their group's (valid) free mean; a failed free rollout does not count.
    r = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    sg = np.array([[1, 1, 0, 0], [1, 1, 0, 0]])
    valid = np.array([[True, True, True, True], [True, True, True, False]])
    sel = np.asarray(self_distillation_select(r, sg, valid))
    np.testing.assert_array_equal(sel, [[True, False, False, False], [False, False, False, False]])


def test_config_keys_are_all_read_somewhere_in_the_package():
    """A key nothing reads is an option that silently does nothing (issue 13.8)."""
    tree = ast.parse(open(os.path.join(REPO, "comprl_jax", "config", "schema.py")).read())
    keys = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Attribute)
            and isinstance(node.targets[0].value, ast.Attribute)
            and isinstance(node.targets[0].value.value, ast.Name)
            and node.targets[0].value.value.id == "c"
        ):
            keys.add((node.targets[0].value.attr, node.targets[0].attr))
    assert ("actor", "self_distill_coef") in keys and len(keys) > 60
    sources = []
    for root, _, files in os.walk(os.path.join(REPO, "comprl_jax")):
        for f in files:
            if f.endswith(".py") and os.path.basename(root) != "config":
                sources.append(open(os.path.join(root, f)).read())
    text = "\n".join(sources)
    unread = sorted(f"{s}.{k}" for s, k in keys if not re.search(rf"\.{k}\b|\[\"{k}\"\]", text))
    assert not unread, f"config keys read nowhere in comprl_jax/: {unread}"


def test_methods_are_flags_and_a_changed_flag_is_caught():
    c = config_lib.build("tiny,static_online", "t")
    assert (c.extractor.train, c.actor.train, c.experience.enabled, c.bank.offline) == (
        False,
        True,
        True,
        False,
    )
    c = config_lib.build("tiny,baseline", "t")
    assert not c.experience.enabled and not c.extractor.train
    c = config_lib.build("tiny", "t")
    with c.unlocked():
        c.method = "baseline"  # a label change alone would do nothing: refused, naming the flags
    with pytest.raises(ValueError, match=r"config key method: .*experience\.enabled=True"):
        config_lib.validate(c)
    with c.unlocked():
        c.method = "custom"
    config_lib.validate(c)


def test_cpu_scale_is_tiny_with_the_learning_settings():
    """Issue 19: ``:cpu`` = ``:tiny`` models with the turn budget, groups and step size that learn on 2 cores."""
    tiny, cpu = config_lib.build("tiny,baseline", "t"), config_lib.build("cpu,baseline", "t")
    assert (
        (cpu.actor.model, cpu.extractor.model) == (tiny.actor.model, tiny.extractor.model) == ("tiny", "tiny")
    )
    got = (cpu.env.max_turns, cpu.rollout.tasks_per_step, cpu.rollout.group_size, cpu.actor.lr)
    assert got == (20, 2, 16, 3e-3) and cpu.actor.updates_per_batch == 2
    config_lib.validate(cpu)
    with pytest.raises(ValueError, match="unknown"):
        config_lib.build("cpus,baseline", "t")


# ---- 9/10. shared bank, step clock, merge keys ---------------------------------------------------------------------


def test_shared_bank_transfers_across_tasks_and_task_partitions_do_not():
    for partition, found in (("shared", True), ("task", False)):
        m = ExperienceManager(
            hash_embed, DIM, None, clock=FakeClock(),
            bank_cfg=BankConfig(partition=partition, index=IndexConfig(scann_min_size=10**9)),
        )  # fmt: skip
        m.apply_output("minihack", answer(add(mem("stairs", "walk to the stairs"))), [], step=0)
        hit = m.search(["walk to the stairs"], ["webshop"])[0]
        assert bool(hit.uids) == found, partition
        assert m.bank.entries[0].task_id == "minihack"  # the entry still records its task
        m.check_invariants()


def test_shared_bank_merges_across_tasks_and_round_trips(tmp_path):
    def merger(prompts):
        return [answer(add(mem("merged", "walk east then south"))) for _ in prompts]

    m = ExperienceManager(
        hash_embed, DIM, merger, clock=FakeClock(),
        bank_cfg=BankConfig(partition="shared", key="query", index=IndexConfig(scann_min_size=10**9)),
    )  # fmt: skip
    m.apply_output("a", answer(add(mem("x", "go east"))), [], step=0, query="query one")
    m.apply_output("b", answer(add(mem("y", "go south"))), [], step=0, query="query two")
    m.merge(1)
    (e,) = m.bank.entries.values()
    assert e.kind == "merge" and e.task_id == "<mixed>"
    # Keyed as added entries are (bank.key="query"): by the originals' queries, with the query embedder.
    assert e.key_text == "query one\nquery two"
    np.testing.assert_allclose(m.bank.vector(e.uid), hash_embed([e.key_text])[0], atol=1e-6)
    m.save(str(tmp_path / "s"))
    r = ExperienceManager.restore(str(tmp_path / "s"), hash_embed, clock=FakeClock())
    assert r.search(["query one"], ["c"])[0].uids == [e.uid]


def test_recency_window_counts_rollout_steps():
    cfg = RetrievalConfig(k=1, candidates=2, lam=0.4, clock="step", window_steps=1, dropout=0.0)
    # Step clock: a candidate retrieved earlier in this step (t = 5) is recent, one from the last step is not.
    # Eq. 6: recent -1 - 0.4 ln 2 - 1 = -2.28 < -2 (the second candidate); not recent: -1.28 > -2.
    assert diversify([1, 0], [5.0, None], now=5.0, cfg=cfg, rng=None) == [1]
    assert diversify([1, 0], [4.0, None], now=5.0, cfg=cfg, rng=None) == [0]
