"""The lock-step rollout engine: every live episode gets one generation per round (one jitted sampler call for the
batch, one per (env id, may ask, tokens per reply) group present), then all env steps run concurrently in the pools
and search & ask questions are answered in one batch. The token ids and the assistant mask handed to the trainer
are exactly the sampled ones (``Conversation`` keeps them); observations are appended to the live KV cache
(incremental prefill), never re-encoding the history.

Multi-process (``gather`` given): every process holds every episode's host state but steps only the env lanes it
owns (:mod:`comprl_jax.rollout.pools`), so all processes issue identical jitted calls. The continuous engine
(:mod:`comprl_jax.rollout.continuous`, the single-process default) plays the same trajectories.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax

from comprl_jax.rollout.engine import Rollout
from comprl_jax.rollout.episodes import Episode, EpisodeSpec, Trajectory, start_episodes
from comprl_jax.rollout.pools import lanes, own_rows


@dataclasses.dataclass(frozen=True)
class Lockstep:
    """The lock-step engine (:class:`comprl_jax.rollout.engine.Engine`). ``gather``: multi-process exchange
    (``{row: value} -> {row: value}`` over all processes; see :func:`comprl_jax.rollout.pools.reset_all`)."""

    gather: Any = None

    def play(
        self, r: Rollout, specs: Sequence[EpisodeSpec], resets: Sequence[tuple[str, dict]], key: jax.Array
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Plays all episodes to the end: ``(trajectories in spec order, {"gen_s", "env_s"})``."""
        B = len(specs)
        lane = lanes(specs)
        own = set(own_rows(B, self.gather))
        conv = r.sampler.conversation(batch=B, max_len=r.max_len)
        sa, sp, tok, im_end = r.search_ask, r.sp, r.tokenizer, r.im_end
        eps = start_episodes(r.pools.system_prompts, specs, resets, tok, sa.tool_text)
        stop_strings = sa.stop_strings(r.stop_strings)
        t_gen = t_env = 0.0
        n_replies = [
            0
        ] * B  # each reply samples with its own key (episode, reply index), as the slot engine's
        # Each round: one generation per live episode, then env steps (or tool answers). Env steps are bounded by
        # the envs' truncation at max_turns and tool turns by the tool's max_calls: at most max_rounds rounds.
        for _round in range(r.max_rounds):
            if not any(e.live for e in eps):
                break
            for b, e in enumerate(eps):
                # An episode whose context cannot hold another turn ends here (truncated, counted), never a crash.
                if e.live and len(conv.ids[b]) + len(e.pending) + e.spec.max_new(sp) > e.spec.max_len(
                    r.max_len
                ):
                    e.live, e.context_full = False, True
            t0 = time.perf_counter()
            replies, reply_len = _generate(r, conv, eps, key, n_replies, stop_strings)
            t1 = time.perf_counter()
            # Search & ask: questions are answered by the extractor as tool turns (no env step), in one batch.
            questions = {}
            for b, e in enumerate(eps):
                q = sa.question(e, replies[b]) if e.live else None
                if q is not None:
                    questions[b] = q
            if questions:
                got = sa.call([(eps[b], q) for b, q in questions.items()])
                for b, (answer, sample_key) in zip(questions, got, strict=True):
                    sa.answer(eps[b], replies[b], answer, sample_key, conv.ids[b], reply_len[b], tok, im_end)
            futs = {
                b: r.pools.pools[e.spec.task.env_id].submit_step(lane[b], replies[b])
                for b, e in enumerate(eps)
                if e.live and b not in questions and b in own
            }
            results = {b: fut.result() for b, fut in futs.items()}
            if self.gather is not None:
                got = self.gather({b: list(v) for b, v in results.items()})
                results = {b: tuple(v) for b, v in sorted(got.items())}
            for b, result in results.items():
                eps[b].observe(replies[b], result, conv.ids[b], tok, im_end)
            t_env += time.perf_counter() - t1
            t_gen += t1 - t0
        trajs = [e.trajectory(*conv.tokens(b), conv.logprobs(b)) for b, e in enumerate(eps)]
        return trajs, {"gen_s": t_gen, "env_s": t_env}


def _generate(
    r: Rollout, conv, eps: list[Episode], key: jax.Array, n_replies: list[int], stop_strings
) -> tuple[list[str], list[int]]:
    """One reply per live episode: one jitted call per (env id, may ask, tokens per reply) group present (usually
    a single call). Returns the replies' text and sampled lengths (row order; "" / 0 for the others)."""
    B, sp = len(eps), r.sp
    replies, reply_len = [""] * B, [0] * B
    group_of = {
        b: (e.spec.task.env_id, r.search_ask.may_ask(e), e.spec.max_new(sp))
        for b, e in enumerate(eps)
        if e.live
    }
    for env_id, asking, max_new in sorted(set(group_of.values())):
        rows = [
            e.pending if group_of.get(b) == (env_id, asking, max_new) else None for b, e in enumerate(eps)
        ]
        constraint = r.constraint_for(env_id, asking) if r.constraint_for else None
        ids = [(b, n_replies[b]) for b in range(B)]
        g_sp = sp if max_new == sp.max_new_tokens else dataclasses.replace(sp, max_new_tokens=max_new)
        res = conv.turn(rows, key, g_sp, stop_strings=stop_strings, constraint=constraint, key_ids=ids)
        for b, row in enumerate(rows):
            if row is not None:
                n_replies[b] += 1
                reply_len[b] = int(res.lengths[b])
                replies[b] = r.tokenizer.decode(
                    res.tokens[b, : int(res.lengths[b])].tolist(), skip_special=True
                )
    return replies, reply_len
