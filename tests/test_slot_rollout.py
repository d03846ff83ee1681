"""The slot engine (sampling/slots.py) and the continuous-batching rollout (rollout/continuous.py): greedy results equal
the lock-step engine's, rows are independent of their batch, and the schedule is reproducible."""

import dataclasses

import jax
import numpy as np
import pytest
from trainer_helpers import load_config

from comprl_jax.sampling import SamplerService, SamplingParams
from comprl_jax.sampling.automaton import from_strings, union
from comprl_jax.sampling.slots import Entry, SlotBatch

V = 300


@pytest.fixture(scope="module")
def service():
    from comprl_jax.models import ModelConfig, init_decoder

    cfg = ModelConfig.tiny(
        "qwen3",
        vocab_size=V,
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    graphdef, params = init_decoder(cfg, seed=0)
    vocab = [b""] * 4 + [bytes([c]) for c in range(97, 123)] + [b"<", b">", b"/", b" "]
    vocab += [b"x%d" % i for i in range(V - len(vocab))]
    return SamplerService(graphdef, params, cfg, vocab=vocab, stop_token_ids=(3,), pad_id=0)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(40, V, int(rng.integers(3, 60))).tolist() for _ in range(n)]


def _play(sb: SlotBatch, prompts, max_new, key, cstart=None, exit_done=1):
    """Every prompt through the slots, new ones entering as others finish; {prompt index: Finished}."""
    queue, free, occupant, got = list(range(len(prompts))), list(range(sb.B)), {}, {}
    while queue or sb.replying:
        entries = []
        while free and queue:
            i, s = queue.pop(0), free.pop(0)
            occupant[s] = i
            entries.append(Entry(s, prompts[i], True, max_new[i], (i, 0), 0 if cstart is None else cstart[i]))
        sb.enter(entries, key)
        for f in sb.collect(sb.advance(exit_done)):
            got[occupant[f.slot]] = f
            free.append(f.slot)
    return got


@pytest.mark.parametrize("slots,chunk", [(2, 4), (4, 16), (16, 3)])
def test_slots_greedy_equal_one_batch_generation(service, slots, chunk):
    """Greedy: every reply (tokens, logprobs, stop) equals SamplerService.generate over all prompts at once, for
    any slot count and chunk length, with a stop string and rows under two different constraints."""
    prompts = _prompts(7)
    max_new = [5, 17, 30, 2, 40, 9, 25]
    sp = SamplingParams(max_new_tokens=40, greedy=True)
    stops = ("cab",)
    a = from_strings(("abc", "abcab", "ba"), service.vocab, service.stop_token_ids)
    b = from_strings(("<a>", "<b>c"), service.vocab, service.stop_token_ids)
    both, starts = union([a, None, b])
    cons = [0, 1, 2, 0, 1, 2, 1]
    key = jax.random.key(3)
    refs = {}
    for which, auto in ((0, a), (1, None), (2, b)):
        rows = [i for i in range(7) if cons[i] == which]
        res = service.generate(
            [prompts[i] for i in rows],
            key,
            sp,
            max_new=[max_new[i] for i in rows],
            stop_strings=stops,
            constraint=None if auto is None else service.replicate(auto),
        )
        for j, i in enumerate(rows):
            refs[i] = (
                res.tokens[j, : int(res.lengths[j])],
                res.logprobs[j, : int(res.lengths[j])],
                res.finish_reason[j],
            )
    sb = SlotBatch(
        service, slots, 256, sp, stop_strings=stops, constraint=service.replicate(both), chunk_steps=chunk
    )
    got = _play(sb, prompts, max_new, key, cstart=[starts[c] for c in cons])
    for i in range(7):
        tok, lp, fin = refs[i]
        assert got[i].tokens.tolist() == tok.tolist(), i
        np.testing.assert_allclose(got[i].logprobs, lp, atol=2e-5, err_msg=str(i))
        assert got[i].finish == int(fin), i
    assert sb.decode_steps > 0


def test_sampled_rows_do_not_depend_on_their_batch(service):
    """Sampling at T=1: a prompt's reply depends only on (key, its key ids), not on the slot count, the chunk
    length or which prompts shared the batch."""
    prompts = _prompts(6, seed=1)
    sp = SamplingParams(max_new_tokens=24, temperature=1.0)
    key = jax.random.key(0)
    one = _play(SlotBatch(service, 6, 256, sp, chunk_steps=24), prompts, [24] * 6, key)
    two = _play(SlotBatch(service, 2, 256, sp, chunk_steps=5), prompts, [24] * 6, key, exit_done=2)
    for i in range(6):
        assert one[i].tokens.tolist() == two[i].tokens.tolist(), i
    assert len({tuple(one[i].tokens.tolist()) for i in range(6)}) > 1


def test_slot_batch_errors_name_the_slot(service):
    sp = SamplingParams(max_new_tokens=8, greedy=True)
    sb = SlotBatch(service, 2, 32, sp)
    with pytest.raises(ValueError, match="slot 1: context 48 tokens exceeds max_len=32"):
        sb.enter([Entry(1, list(range(40, 80)), True, 8, (0, 0))], jax.random.key(0))
    sb.enter([Entry(0, [40, 41], True, 8, (0, 0))], jax.random.key(0))
    with pytest.raises(ValueError, match="slot 0 is still replying"):
        sb.enter([Entry(0, [40], False, 8, (0, 1))], jax.random.key(0))
    with pytest.raises(ValueError, match="slot 0 is still replying; only an idle slot can be parked"):
        sb.park([0])
    with pytest.raises(ValueError, match="slot 1: park row 0 holds no parked row"):
        sb.enter([Entry(1, [40], False, 8, (1, 0), park_row=0)], jax.random.key(0))


def test_parked_rows_continue_in_other_slots(service):
    """Two-turn replies on 2 slots for 4 prompts: after turn 1 each row is parked, and turn 2 continues it from
    the parking store in whichever slot is free. Every reply (sampled, T=1) equals the one generated with a slot
    per prompt and no parking."""
    prompts = _prompts(4, seed=2)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0)
    key = jax.random.key(7)

    def run(slots, park):
        sb = SlotBatch(service, slots, 256, sp, chunk_steps=5)
        got, rows, turn2 = {}, {}, [[50, 51, 52, 53][i : i + 2] for i in range(4)]
        for turn in range(2):
            queue, free, occupant = list(range(4)), list(range(sb.B)), {}
            while queue or sb.replying:
                entries = []
                while free and queue:
                    i, s = queue.pop(0), free.pop(0)
                    occupant[s] = i
                    if turn == 0:
                        entries.append(Entry(s, prompts[i], True, 12, (i, 0)))
                    else:  # the reply's last token (never fed) first, then the next input
                        toks = [int(got[i, 0].tokens[-1])] + turn2[i]
                        entries.append(Entry(s, toks, False, 12, (i, 1), park_row=rows.get(i, -1)))
                sb.enter(entries, key)
                for f in sb.collect(sb.advance(1)):
                    i = occupant.pop(f.slot)
                    got[i, turn] = f
                    if park and turn == 0:
                        rows[i] = sb.park([f.slot])[0]
                    free.append(f.slot)
        return got, sb

    ref, _ = run(4, park=False)
    got, sb = run(2, park=True)
    assert sb.parked == 4 and sorted(sb.park_free) == list(range(len(sb.park_free)))  # every row came back
    for k, f in ref.items():
        assert got[k].tokens.tolist() == f.tokens.tolist(), k
        np.testing.assert_allclose(got[k].logprobs, f.logprobs, atol=2e-5)


def test_union_keeps_each_automaton():
    vocab = [b"", b"a", b"b", b"c"]
    a = from_strings(("ab",), vocab, (0,))
    b = from_strings(("c", "cb"), vocab, (0,))
    u, starts = union([a, b, None])
    allowed, nxt = np.asarray(u.allowed), np.asarray(u.next_state)

    def walk(start, toks):
        s = start
        for t in toks:
            assert allowed[s, t]
            s = int(nxt[s, t])
        return s

    assert starts[0] == 0 and starts[1] == a.num_states and starts[2] == a.num_states + b.num_states
    assert np.asarray(u.accept)[walk(starts[0], [1, 2])]
    assert not allowed[starts[0], 3] and allowed[starts[1], 3] and not allowed[starts[1], 1]
    assert np.asarray(u.accept)[walk(starts[1], [3, 2])]
    assert allowed[starts[2]].all()
    assert union([None, None]) == (None, (0, 0))


# -- the rollout ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from comprl_jax.loop.trainer import Trainer

    c = load_config(
        "minihack_room",
        "tiny",
        **{"rollout.tasks_per_step": 2, "rollout.group_size": 4, "env.max_turns": 4, "env.workers": 2},
    )
    tr = Trainer(c, str(tmp_path_factory.mktemp("slot_rollout")))
    yield tr
    tr.close()


def _both(
    tr, sp, slots, ask=None, constraint_for=None, env_lag=1, turn_tokens=None, sampler=None, specs=None
):
    from comprl_jax.rollout.continuous import Continuous
    from comprl_jax.rollout.engine import Rollout
    from comprl_jax.rollout.lockstep import Lockstep
    from comprl_jax.rollout.pools import reset_all
    from comprl_jax.rollout.search_ask import NO_SEARCH_ASK, SearchAsk

    specs = specs or tr.episode_specs(tr.tasks.next(), guided=True)
    for i, s in enumerate(specs):
        s.can_ask = ask is not None and s.guided
        if turn_tokens is not None:
            s.turn_tokens = turn_tokens[i % len(turn_tokens)]
    r = Rollout(
        tr.pools,
        sampler or tr.actor.sampler,
        tr.actor.model.tokenizer,
        sp,
        max_turns=4,
        max_len=2048,
        constraint_for=constraint_for or tr._constraint,
        search_ask=NO_SEARCH_ASK if ask is None else SearchAsk(ask, 2),
    )
    key = jax.random.key(1)
    lock, _ = Lockstep().play(r, specs, reset_all(tr.pools, specs), key)
    engine = Continuous(slots=slots, chunk_steps=8, env_lag=env_lag)
    cont, timing = engine.play(r, specs, reset_all(tr.pools, specs), key)
    return lock, cont, timing


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens and x.loss_mask == y.loss_mask and x.ask_spans == y.ask_spans
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=2e-5)
        assert (x.reward, x.success, x.turns, x.num_invalid, x.transcript, x.final_obs, x.asks) == (
            y.reward,
            y.success,
            y.turns,
            y.num_invalid,
            y.transcript,
            y.final_obs,
            y.asks,
        )


def test_paged_kv_cache_plays_the_same_episodes(trainer):
    """Issue 30: the actor's sampler on a paged KV cache (pages of 16; {role}.kv_cache = "paged"): both engines,
    sampled, 8 episodes on 3 slots (parking moves page lists), give the dense lock-step engine's trajectories."""
    from comprl_jax.sampling import SamplerService

    s = trainer.actor.sampler
    paged = SamplerService(
        s.graphdef,
        s.params,
        s.cfg,
        vocab=s.vocab,
        stop_token_ids=s.stop_token_ids,
        pad_id=s.pad_id,
        kv_cache="paged",
        page_size=16,
    )
    sp = SamplingParams(max_new_tokens=trainer.actor_sampling.max_new_tokens, temperature=1.0)
    specs = trainer.episode_specs(trainer.tasks.next(), guided=True)  # the same tasks for both caches
    lock, _, _ = _both(trainer, sp, 3, env_lag=2, specs=specs)
    lock_p, cont_p, timing = _both(trainer, sp, 3, env_lag=2, sampler=paged, specs=specs)
    _same(lock, lock_p)
    _same(lock, cont_p)
    assert timing["parked"] > 0


def test_a_play_whose_every_reset_failed_ends_in_both_engines(trainer):
    """Every env failed on reset (an infra fault): no episode is live, so both engines return the failed episodes
    untouched (the continuous one used to try to shrink its batch to no slot and raise IndexError)."""
    from comprl_jax.rollout.continuous import Continuous
    from comprl_jax.rollout.engine import Rollout
    from comprl_jax.rollout.lockstep import Lockstep

    specs = trainer.episode_specs(trainer.tasks.next(), guided=False)
    resets = [("", {"failed": True, "error": "reset of slot 0 failed: boom"})] * len(specs)
    sp = SamplingParams(max_new_tokens=trainer.actor_sampling.max_new_tokens, temperature=1.0)
    r = Rollout(
        trainer.pools, trainer.actor.sampler, trainer.actor.model.tokenizer, sp, max_turns=4, max_len=2048
    )
    key = jax.random.key(1)
    lock, _ = Lockstep().play(r, specs, resets, key)
    cont, timing = Continuous(slots=3, chunk_steps=8).play(r, specs, resets, key)
    _same(lock, cont)
    assert len(cont) == len(specs) and not any(t.success or t.turns or sum(t.loss_mask) for t in cont)
    assert timing["generated"] == timing["decode_steps"] == 0


@pytest.mark.parametrize("slots,greedy,env_lag", [(3, True, 1), (3, False, 2), (0, False, 1)])
def test_continuous_rollout_equals_lockstep(trainer, slots, greedy, env_lag):
    """MiniHack, constrained actions, 8 episodes on 3 slots (episodes wait for slots, idle ones are parked and
    continue in other slots) or one slot each: the same trajectories as the lock-step engine, greedy and sampled
    (both engines draw reply i of episode b with the key (b, i))."""
    sp = SamplingParams(max_new_tokens=trainer.actor_sampling.max_new_tokens, temperature=1.0, greedy=greedy)
    lock, cont, timing = _both(trainer, sp, slots, env_lag=env_lag)
    _same(lock, cont)
    assert sum(t.turns for t in cont) > len(cont)  # episodes went on past their first turn
    assert timing["generated"] == sum(sum(t.loss_mask) for t in cont)
    assert 0 < timing["generated"] <= timing["slot_steps"]
    if slots:
        assert timing["parked"] > 0  # the parking path ran
    if not greedy:
        assert len({tuple(t.tokens) for t in cont}) > 2  # sampling: the group's episodes differ


def test_per_episode_turn_tokens_bound_each_reply_in_both_engines(trainer):
    """A mixture's envs keep their own tokens per turn (EpisodeSpec.turn_tokens, envs.registry.Limits): episodes
    capped at 2 tokens never sample more per reply, the others keep the run's cap, and both engines agree."""
    sp = SamplingParams(max_new_tokens=trainer.actor_sampling.max_new_tokens, temperature=1.0)
    lock, cont, _ = _both(trainer, sp, 3, turn_tokens=[2, 0])

    def replies(t):  # lengths of the runs of sampled tokens
        runs, n = [], 0
        for m in t.loss_mask + [0]:
            if m:
                n += 1
            elif n:
                runs.append(n)
                n = 0
        return runs

    _same(lock, cont)
    assert all(max(replies(t)) <= 2 for t in cont if t.spec.turn_tokens == 2)
    assert max(max(replies(t)) for t in cont if t.spec.turn_tokens == 0) > 2


@pytest.mark.slow
def test_continuous_rollout_search_and_ask_equals_lockstep(trainer):
    """Replies that ask are answered as tool turns (no env step) in both engines, with the same transcripts."""
    forced = trainer.actor.sampler.strings_constraint(
        ("<knowledge_search_and_ask>where are the stairs</knowledge_search_and_ask>", "<answer>east</answer>")
    )
    calls, situations = [], []

    def ask(items):
        calls.append(len(items))
        situations.extend(s for _, s, _ in items)
        return [(f"answer to {q} in {env_id}", None) for q, _obs, env_id in items]

    sp = SamplingParams(max_new_tokens=48, temperature=1.0)
    lock, cont, _ = _both(trainer, sp, 3, ask=ask, constraint_for=lambda e, a=False: forced)
    _same(lock, cont)
    asked = [t for t in cont if t.asks]
    assert asked and all(t.spec.guided and t.asks <= 2 for t in asked)
    # The refinement call sees the episode's goal, not only the current observation (SPEC §5).
    goals = {f"Goal: {t.goal}\nCurrent observation: " for t in asked}
    assert situations and all(any(s.startswith(g) for g in goals) for s in situations)
    assert all(
        "[search & ask answer] answer to where are the stairs" in t.transcript_text(10_000) for t in asked
    )
    # Self-distillation's row of an asking episode: no question, no answer, no tool text, every action kept.
    from comprl_jax.roles.train_batches import strip_experience
    from comprl_jax.rollout.search_ask import search_ask_prompt

    tok = trainer.actor.model.tokenizer
    for t in asked:
        assert len(t.ask_spans) == t.asks
        ids, mask = strip_experience(
            t, tok, trainer.pools.system_prompts[t.spec.task.env_id], search_ask_prompt(2)
        )
        text, full = tok.decode(ids), tok.decode(t.tokens)
        # (a reply cut off inside the tag by max_new_tokens was no question: an invalid action, kept)
        assert "</knowledge_search_and_ask>" not in text and "answer to" not in text and "Tool:" not in text
        tool = search_ask_prompt(2)  # its text names the <answer> tag too
        assert text.count("<answer>") == full.count("<answer>") - tool.count("<answer>")
        assert sum(mask) == sum(t.loss_mask) - sum(sum(t.loss_mask[a:b]) for a, b in t.ask_spans)


@pytest.mark.slow
def test_continuous_rollout_is_reproducible(trainer):
    """Sampling at T=1 through the env pools' threads: runs on 3 and on 8 slots give identical trajectories (the
    schedule never depends on timing, and row keys are per episode and turn, not per batch)."""
    from comprl_jax.rollout.continuous import Continuous
    from comprl_jax.rollout.engine import Rollout
    from comprl_jax.rollout.pools import reset_all

    sp = SamplingParams(max_new_tokens=trainer.actor_sampling.max_new_tokens, temperature=1.0)
    specs = trainer.episode_specs(trainer.tasks.next(), guided=False)
    tok = trainer.actor.model.tokenizer
    r = Rollout(trainer.pools, trainer.actor.sampler, tok, sp, 4, 2048, constraint_for=trainer._constraint)
    key = jax.random.key(5)
    runs = [Continuous(slots=s).play(r, specs, reset_all(trainer.pools, specs), key)[0] for s in (3, 8)]
    _same(runs[0], runs[1])


def test_tiny_actor_starts_uniform_over_the_actions(trainer):
    """The tiny vocabulary spells each action as one token and the tiny actor's constraint allows one path per
    action, so the random-init actor's first move is near uniform over the 8 directions. (Before: every
    tokenization was a path, and the first moves were east 26%, west 27% ... south 3%: a policy below random.)"""
    from comprl_jax.sampling.automaton import accepts

    tok = trainer.actor.model.tokenizer
    env_id = trainer.config.env.tasks[0]
    actions, _ = trainer.pools.action_spaces[env_id]
    prefix = tok.encode("<answer>")
    for a in actions:
        assert len(tok.encode(f"<answer>{a}</answer>")) == len(tok.encode("<answer></answer>")) + 1, a
    auto = trainer._constraint(env_id, False)
    allowed, nxt = np.asarray(auto.allowed), np.asarray(auto.next_state)
    s = 0
    for t in prefix:
        assert set(np.flatnonzero(allowed[s])) == {t}
        s = int(nxt[s, t])
    assert set(np.flatnonzero(allowed[s])) == {tok.encode(a)[0] for a in actions}
    # With search & ask: the same action paths, or the tag with a question.
    ask = trainer._constraint(env_id, True)
    assert all(accepts(ask, tok.encode(f"<answer>{a}</answer>")) for a in actions)
    assert accepts(ask, tok.encode("<knowledge_search_and_ask>where is it</knowledge_search_and_ask>"))
    assert not accepts(
        ask, tok.encode("<answer>") + [tok.encode(c)[0] for c in "north"] + tok.encode("</answer>")
    )
    # The random-init actor's first action over 512 samples of the first observation: every direction is drawn,
    # none far from 1/8.
    obs = trainer.pools.pools[env_id].submit_reset(0, 0).result()[0]
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": trainer.pools.system_prompts[env_id]},
         {"role": "user", "content": f"Observation: {obs}"}], add_generation_prompt=True)[0]  # fmt: skip
    sp = SamplingParams(max_new_tokens=16, temperature=1.0)
    res = trainer.actor.sampler.generate([prompt] * 512, jax.random.key(0), sp, constraint=auto)
    first = res.tokens[:, len(prefix)]
    share = np.array([np.mean(first == tok.encode(a)[0]) for a in actions])
    assert np.isclose(share.sum(), 1.0) and share.min() > 0.05 and share.max() < 0.25, dict(
        zip(actions, share, strict=True)
    )


def test_the_runs_constraint_groups_fix_the_automaton_and_change_no_token(trainer):
    """Rollout.constraint_groups: a play whose episodes need fewer groups (evaluation plays one env and mode at a
    time) still stacks the run's whole union, so its automaton, hence its compiled decode, is the training one; the
    blocks no row starts in change no sampled token."""
    from comprl_jax.rollout.continuous import Continuous
    from comprl_jax.rollout.engine import Rollout
    from comprl_jax.rollout.pools import reset_all

    env = trainer.config.env.tasks[0]
    sp = SamplingParams(max_new_tokens=trainer.actor_sampling.max_new_tokens, temperature=1.0)
    specs = trainer.episode_specs(trainer.tasks.next(), guided=False)  # these need (env, False) only
    tok = trainer.actor.model.tokenizer
    plain = Rollout(
        trainer.pools, trainer.actor.sampler, tok, sp, 4, 2048, constraint_for=trainer._constraint
    )
    run_wide = dataclasses.replace(plain, constraint_groups=((env, False), (env, True)))
    engine = Continuous(slots=4)
    states = {
        name: int(engine._slot_batch(r, specs)[0].constraint.allowed.shape[0])
        for name, r in (("plain", plain), ("run_wide", run_wide))
    }
    own = [int(trainer._constraint(env, a).allowed.shape[0]) for a in (False, True)]
    assert states == {"plain": own[0], "run_wide": own[0] + own[1]}
    key = jax.random.key(6)
    a, b = (engine.play(r, specs, reset_all(trainer.pools, specs), key)[0] for r in (plain, run_wide))
    _same(a, b)
