"""Multi-turn rollouts: env pools (host threads / processes) <-> the actor's sampler (device), token in / token out.

One call runs a whole rollout batch in lock-step turns: every live episode gets one generation per turn (one
jitted sampler call for the batch), then all env steps run concurrently in the pools. The token ids and the
assistant mask handed to the trainer are exactly the sampled ones (``Conversation`` keeps them); observations
are appended to the live KV cache (incremental prefill), never re-encoding the history.

Episode = ``EpisodeSpec`` (task, group member, guided or not, the experience block in its system prompt).

Multi-process (``gather`` given): every process holds every episode's host state, but steps only the env slots
it owns (:func:`comprl_jax.runtime.distributed.owned_rows`); the results are all-gathered after each reset / step, so
all processes build identical sampler inputs and issue identical jitted calls.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from comprl_jax.envs.pool import EnvPool
from comprl_jax.rollout.tasks import Task

ASK_OPEN = "<knowledge_search_and_ask>"
ASK_CLOSE = "</knowledge_search_and_ask>"
ASK_RE = re.compile(r"<knowledge_search_and_ask>(.*?)</knowledge_search_and_ask>", re.DOTALL)
ANSWER_OPEN = "<answer>"
# What the constraint automaton lets a tiny model ask (search & ask): a short lowercase question.
ASK_QUERY_REGEX = r"[a-z][a-z ]{0,23}"


def search_ask_prompt(max_calls: int) -> str:
    """The tool description added to the system message of episodes that may use search & ask (SPEC §5)."""
    return (
        "Tool: you may ask the experience bank a question instead of acting, by replying with "
        f"{ASK_OPEN}your question{ASK_CLOSE} (no <answer>). The answer comes back as a tool message and does not "
        f"use up an action. At most {max_calls} questions per episode."
    )


@dataclasses.dataclass
class EpisodeSpec:
    task: Task
    member: int  # index inside the task's group of K
    guided: bool
    experience: str = ""  # formatted experience block ("" for free rollouts)
    entry_uids: tuple = ()  # bank entries shown to this episode
    can_ask: bool = False  # search & ask available (SPEC §5: guided episodes by default)
    critic_score: float | None = None  # actor-critic judgement s of the retrieved entry (SPEC §7), if any
    # the env's own limits under the run's caps (envs.registry.capped): tokens per reply and the episode's context;
    # 0 = the engine call's sp.max_new_tokens / max_len
    turn_tokens: int = 0
    context: int = 0

    def max_new(self, sp) -> int:
        return min(self.turn_tokens or sp.max_new_tokens, sp.max_new_tokens)

    def max_len(self, max_len: int) -> int:
        return min(self.context or max_len, max_len)


@dataclasses.dataclass
class Trajectory:
    """One finished episode: exactly the token ids the sampler produced and consumed, and what happened.

    ``tokens`` / ``loss_mask`` / ``logprobs`` are aligned: the mask is 1 on sampled tokens, and ``logprobs`` holds
    the sampler's log-probability of each sampled token (0 elsewhere), the behaviour policy of the update.
    ``infra_failed``: the env raised, hung or its worker died (pool ``info["failed"]``); such an episode says
    nothing about the agent and is masked out of advantages, extractor rewards and success rates.
    """

    spec: EpisodeSpec
    tokens: list[int]
    loss_mask: list[int]
    reward: float
    success: bool
    turns: int
    num_invalid: int
    goal: str
    query: str
    transcript: list[tuple[str, str]]  # (observation, reply) per turn, for the extractor
    final_obs: str
    error: str | None = None
    context_full: bool = False  # ended because the actor's context (rollout.max_context) was full
    ask_keys: list = dataclasses.field(default_factory=list)  # search & ask extractor samples used
    logprobs: list[float] = dataclasses.field(default_factory=list)
    infra_failed: bool = False
    asks: int = 0  # search & ask calls made
    # [start, end) spans of ``tokens`` holding each search & ask exchange (question turn + tool answer)
    ask_spans: list = dataclasses.field(default_factory=list)

    def transcript_text(self, max_chars: int) -> str:
        """``Observation: .. / Action: ..`` lines, keeping the *end* of long episodes (where the outcome is)."""
        lines = []
        for obs, reply in self.transcript:
            lines.append(f"Observation: {obs.strip()}\nAction: {reply.strip()}")
        lines.append(f"Final observation: {self.final_obs.strip()}")
        text = "\n".join(lines)
        return text if len(text) <= max_chars else "...\n" + text[-max_chars:]


def system_message(base_prompt: str, experience: str, tool: str = "") -> str:
    """The env's system prompt, the search & ask tool description (if available to the episode), then the
    retrieved experience block (its header says it is distilled knowledge that may be partly wrong:
    :func:`comprl_jax.experience.retrieval.format_experience`)."""
    return "\n\n".join(x for x in (base_prompt, tool, experience) if x)


class Pools:
    """One :class:`EnvPool` per env id of the mixture, each with ``slots`` lanes, plus each env's system prompt and
    action space (``actions``: a static action set, or ``action_regex``: the action syntax; for constrained decoding)."""

    def __init__(
        self,
        env_ids: Sequence[str],
        slots_per_env: int,
        workers: int,
        backend: str,
        max_turns: int | Mapping[str, int],
        timeout_s: float,
        env_kwargs: dict | None = None,
    ):
        """``max_turns``: one value for every env, or one per env id; ``env_kwargs``: extra constructor arguments of
        every env (e.g. ``{"split": "valid_unseen"}``)."""
        from comprl_jax.envs import registry

        self.pools: dict[str, EnvPool] = {}
        self.system_prompts: dict[str, str] = {}
        self.action_spaces: dict[str, tuple[tuple[str, ...] | None, str | None]] = {}
        for env_id in env_ids:
            turns = max_turns[env_id] if isinstance(max_turns, Mapping) else max_turns
            kwargs = {"max_turns": int(turns), **(env_kwargs or {})}
            self.pools[env_id] = EnvPool(
                env_id,
                slots_per_env,
                num_workers=workers,
                backend=backend,
                env_kwargs=kwargs,
                timeout_s=timeout_s,
            )
            # System prompt and action space are static per env class; read them off one local instance (no reset).
            env = registry.make(env_id, **kwargs)
            try:
                self.system_prompts[env_id] = env.system_prompt()
                actions = getattr(env, "actions", None)
                self.action_spaces[env_id] = (
                    tuple(actions) if actions else None,
                    getattr(env, "action_regex", None),
                )
            finally:
                env.close()

    def close(self) -> None:
        for p in self.pools.values():
            p.close()


def reset_all(pools: Pools, specs: Sequence[EpisodeSpec], gather: Any = None) -> list[tuple[str, dict]]:
    """Resets every episode (the K of a group share the task seed) and returns ``(obs, info)`` per spec.

    ``gather``: multi-process exchange (``{row: value} -> {row: value}`` over all processes); this process then
    resets only the rows it owns.
    """
    slot_of = _slots(specs)
    rows = _own(len(specs), gather)
    futs = {i: pools.pools[specs[i].task.env_id].submit_reset(slot_of[i], specs[i].task.seed) for i in rows}
    if gather is None:
        return [futs[i].result() for i in rows]
    got = gather({i: list(f.result()) for i, f in futs.items()})
    return [(got[i][0], got[i][1]) for i in range(len(specs))]


def _own(n: int, gather: Any) -> range:
    if gather is None:
        return range(n)
    from comprl_jax.runtime.distributed import owned_rows

    return owned_rows(n)


def _slots(specs: Sequence[EpisodeSpec]) -> list[int]:
    """Slot index per spec, counted per env id in order."""
    seen: dict[str, int] = {}
    out = []
    for s in specs:
        out.append(seen.get(s.task.env_id, 0))
        seen[s.task.env_id] = out[-1] + 1
    return out


@dataclasses.dataclass
class _Episode:
    """One row of :func:`run_episodes` while it plays: everything that becomes its :class:`Trajectory`."""

    spec: EpisodeSpec
    info0: dict  # the reset's info (goal, query)
    obs: str  # the latest observation
    pending: list[int]  # token ids of the next input (system + first observation, then each next message)
    live: bool
    infra: bool
    error: str | None
    transcript: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    turns: int = 0
    invalid: int = 0
    context_full: bool = False
    asked: list = dataclasses.field(default_factory=list)  # search & ask sample keys (None: no sample)
    # [start, end) token spans of each search & ask exchange: the question turn and the tool's answer up to the next
    # reply (self-distillation strips them, SPEC §7)
    ask_spans: list = dataclasses.field(default_factory=list)

    def record(self, reply: str) -> None:
        """Transcript line of this turn; after a tool answer the reply belongs to that answer's line."""
        t = self.transcript
        if t and t[-1][1] == "" and t[-1][0].startswith("[search & ask"):
            t[-1] = (t[-1][0], reply)
        else:
            t.append((self.obs, reply))

    def step(self, reply: str, result) -> bool:
        """Applies an env step's ``(obs, reward, terminated, truncated, info)``; True when the episode goes on."""
        o, r, term, trunc, info = result
        self.record(reply)
        self.turns += 1
        self.reward += float(r)
        self.invalid = int(info.get("num_invalid", self.invalid))
        self.success = bool(info.get("success", False))
        if info.get("error"):
            self.error = str(info["error"])
        if info.get("failed"):
            self.infra = True
        self.obs = o
        if term or trunc:
            self.live = False
        return self.live

    def trajectory(self, ids: list[int], mask: list[int], logprobs: list[float]) -> Trajectory:
        return Trajectory(
            spec=self.spec,
            tokens=ids,
            loss_mask=mask,
            reward=self.reward,
            success=self.success and not self.infra,
            turns=self.turns,
            num_invalid=self.invalid,
            goal=str(self.info0.get("goal", "")),
            query=str(self.info0.get("query", "")),
            transcript=self.transcript,
            final_obs=self.obs,
            error=self.error,
            context_full=self.context_full,
            ask_keys=[k for k in self.asked if k is not None],
            logprobs=logprobs,
            infra_failed=self.infra,
            asks=len(self.asked),
            ask_spans=[(a, min(b, len(ids))) for a, b in self.ask_spans],
        )


def _first_input(pools: Pools, spec: EpisodeSpec, obs: str, tokenizer, tool_text: str) -> list[int]:
    """System message (env prompt, tool, experience) + the first observation, with the generation prompt."""
    base = pools.system_prompts[spec.task.env_id]
    system = system_message(base, spec.experience, tool_text if spec.can_ask else "")
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"Observation: {obs}"}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)[0]


def start_episodes(pools: Pools, specs, resets, tokenizer, tool_text: str) -> list[_Episode]:
    """One :class:`_Episode` per spec from its reset ``(obs, info)`` (a failed reset is an infra-failed episode),
    its first input already tokenised; both engines start from these."""
    return [
        _Episode(
            spec=s,
            info0=info,
            obs=obs,
            pending=_first_input(pools, s, obs, tokenizer, tool_text),
            live=not info.get("failed", False),
            infra=bool(info.get("failed", False)),
            error=info.get("error"),
        )
        for s, (obs, info) in zip(specs, resets, strict=True)
    ]


def _next_input(context: list[int], message: dict, tokenizer, im_end: int | None) -> list[int]:
    """Closes the assistant turn if it stopped on a stop string (its <|im_end|> was never sampled: mask 0)
    and appends the next user / tool message with the generation prompt."""
    close = im_end is not None and (not context or context[-1] != im_end)
    cont, _ = tokenizer.encode_chat_continuation([message], add_generation_prompt=True)
    return ([im_end] if close else []) + cont


def ask_situation(e: _Episode) -> str:
    """What search & ask's refinement call sees of the asking episode: its goal (ALFWorld's and WebShop's goal is
    only in the first observation) and the current observation."""
    goal = str(e.info0.get("goal", "")).strip()
    return f"Goal: {goal}\nCurrent observation: {e.obs}" if goal else e.obs


def answer_ask(
    e: _Episode, reply: str, answer: str | None, sample_key, ids: list[int], reply_len: int, tokenizer, im_end
):
    """One search & ask tool turn (both engines): ``reply`` (its ``reply_len`` sampled ids end ``ids``, the
    context so far) asked a question; ``answer`` (None: unparsable) comes back as a tool message, the next input.
    The exchange's token span is recorded for self-distillation's stripping."""
    text = answer if answer is not None else "[No answer]"
    e.asked.append(sample_key)
    e.record(reply)
    e.transcript.append((f"[search & ask answer] {text}", ""))  # reply: the next turn's
    e.pending = _next_input(ids, {"role": "tool", "content": text}, tokenizer, im_end)
    e.ask_spans.append((len(ids) - reply_len, len(ids) + len(e.pending)))


def run_episodes(
    pools: Pools,
    specs: Sequence[EpisodeSpec],
    resets: Sequence[tuple[str, dict]],
    sampler: Any,
    tokenizer: Any,
    sp: Any,
    key: jax.Array,
    *,
    max_turns: int,
    max_len: int,
    constraint_for: Any = None,
    stop_strings: Sequence[str] = ("</answer>",),
    ask: Any = None,
    ask_max: int = 2,
    gather: Any = None,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Plays all episodes to the end. Returns trajectories (spec order) and timing stats.

    Args:
      specs / resets: episodes and their ``(obs, info)`` from :func:`reset_all`.
      sampler: the actor's ``SamplerService``; tokenizer: its ``Tokenizer``; sp: ``SamplingParams``.
      key: PRNG key; reply ``i`` of episode ``b`` samples with ``fold_in(fold_in(key, b), i)`` (both engines).
      max_turns: env actions per episode (the env truncates there); search & ask turns do not count.
      constraint_for: ``(env_id, can_ask) -> TokenAutomaton | None`` (constrained decoding for tiny models);
        ``can_ask``: the row may still use search & ask this turn, so its automaton also allows the tool tag.
      ask: search & ask (SPEC §5) for episodes with ``spec.can_ask``: ``[(question, situation, env_id)] ->
        [(answer | None, sample key | None)]`` (one batched call per turn). A reply holding
        ``<knowledge_search_and_ask>q</knowledge_search_and_ask>`` and no ``<answer>`` (at most ``ask_max`` times
        per episode) is answered as a tool message instead of an env step; the keys are returned per trajectory in
        ``Trajectory.ask_keys`` so the trainer can reward those extractor samples with the episode outcome.
      gather: multi-process exchange (see :func:`reset_all`): env steps of the rows this process owns, then
        all-gathered.
    """
    B = len(specs)
    slot_of = _slots(specs)
    own = set(_own(B, gather))
    conv = sampler.conversation(batch=B, max_len=max_len)
    tool_text = search_ask_prompt(ask_max) if ask is not None else ""
    im_end = tokenizer.special_ids.get("<|im_end|>")
    eps = start_episodes(pools, specs, resets, tokenizer, tool_text)
    if ask is not None:
        stop_strings = tuple(stop_strings) + (ASK_CLOSE,)
    t_gen = t_env = 0.0
    replies_so_far = [
        0
    ] * B  # each reply samples with its own key (episode, reply index), as the slot engine's

    def can_ask(e: _Episode) -> bool:
        return ask is not None and e.spec.can_ask and len(e.asked) < ask_max

    # Each round: one generation per live episode, then env steps (or tool answers). Env steps are bounded by
    # the envs' truncation at max_turns and tool turns by ask_max, so this ends after max_turns + ask_max rounds.
    for _round in range(max_turns + (ask_max if ask is not None else 0)):
        if not any(e.live for e in eps):
            break
        for b, e in enumerate(eps):
            # An episode whose context cannot hold another turn ends here (truncated, counted), never a crash.
            if e.live and len(conv.ids[b]) + len(e.pending) + e.spec.max_new(sp) > e.spec.max_len(max_len):
                e.live, e.context_full = False, True
        t0 = time.perf_counter()
        # One jitted call per (env id, may ask, tokens per turn) group present; usually a single call.
        replies: list[str] = [""] * B
        reply_len = [0] * B
        group_of = {
            b: (e.spec.task.env_id, can_ask(e), e.spec.max_new(sp)) for b, e in enumerate(eps) if e.live
        }
        for env_id, asking, max_new in sorted(set(group_of.values())):
            rows = [
                e.pending if group_of.get(b) == (env_id, asking, max_new) else None for b, e in enumerate(eps)
            ]
            constraint = constraint_for(env_id, asking) if constraint_for else None
            ids = [(b, replies_so_far[b]) for b in range(B)]
            g_sp = sp if max_new == sp.max_new_tokens else dataclasses.replace(sp, max_new_tokens=max_new)
            res = conv.turn(rows, key, g_sp, stop_strings=stop_strings, constraint=constraint, key_ids=ids)
            for b, r in enumerate(rows):
                if r is not None:
                    replies_so_far[b] += 1
                    reply_len[b] = int(res.lengths[b])
                    replies[b] = tokenizer.decode(
                        res.tokens[b, : int(res.lengths[b])].tolist(), skip_special=True
                    )
        t1 = time.perf_counter()
        # Search & ask: questions are answered by the extractor as tool turns (no env step), in one batch.
        questions = {}
        for b, e in enumerate(eps):
            q = ASK_RE.search(replies[b]) if e.live and can_ask(e) else None
            if q and ANSWER_OPEN not in replies[b]:
                questions[b] = q.group(1).strip()
        answered: set[int] = set()
        if questions:
            got = ask([(q, ask_situation(eps[b]), eps[b].spec.task.env_id) for b, q in questions.items()])
            for b, (answer, sample_key) in zip(questions, got, strict=True):
                answer_ask(
                    eps[b], replies[b], answer, sample_key, conv.ids[b], reply_len[b], tokenizer, im_end
                )
                answered.add(b)
        futs = {
            b: pools.pools[e.spec.task.env_id].submit_step(slot_of[b], replies[b])
            for b, e in enumerate(eps)
            if e.live and b not in answered and b in own
        }
        results = {b: fut.result() for b, fut in futs.items()}
        if gather is not None:
            results = {
                b: tuple(v) for b, v in sorted(gather({b: list(v) for b, v in results.items()}).items())
            }
        for b, result in results.items():
            e = eps[b]
            if e.step(replies[b], result):
                message = {"role": "user", "content": f"Observation: {e.obs}"}
                e.pending = _next_input(conv.ids[b], message, tokenizer, im_end)
        t_env += time.perf_counter() - t1
        t_gen += t1 - t0
    trajs = [e.trajectory(*conv.tokens(b), conv.logprobs(b)) for b, e in enumerate(eps)]
    return trajs, {"gen_s": t_gen, "env_s": t_env}


def outcome(traj: Trajectory) -> float:
    """Scalar outcome used as the RL reward: 1 on success, else the env's failure reward (ALFWorld: -1, SPEC §2;
    registered with the env, :func:`comprl_jax.envs.registry.failure_reward`)."""
    from comprl_jax.envs.registry import failure_reward

    return 1.0 if traj.success else failure_reward(traj.spec.task.env_id)


def success_rate(trajs: Sequence[Trajectory]) -> float:
    """Binary success over the episodes that did not fail for infrastructure reasons."""
    ok = [t.success for t in trajs if not t.infra_failed]
    return float(np.mean(ok)) if ok else float("nan")


def corpus_strings(ask_max: int = 2) -> list[str]:
    """Strings of the actor's prompts built here (a tiny run's tokenizer is trained on them)."""
    return [
        "Observation: ",
        search_ask_prompt(ask_max),
        f"{ASK_OPEN}where are the stairs{ASK_CLOSE}",
        "[search & ask answer] [No answer]",
    ]
