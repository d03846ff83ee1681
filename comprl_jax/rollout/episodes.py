"""Episode records shared by the rollout engines: what an episode is (``EpisodeSpec``), what it becomes
(``Trajectory``), and its state while an engine plays it (``Episode``: transcript, env step results, the next
input's token ids).

An episode's first input is the system message (the env's prompt, the search & ask tool text when the episode may
ask, the retrieved experience block) and the first observation; every next input is one user (observation) or tool
(search & ask answer) message appended to the exact ids sampled so far (:func:`next_input`), never a re-encoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from comprl_jax.rollout.tasks import Task


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


@dataclasses.dataclass
class Episode:
    """One episode while an engine plays it: everything that becomes its :class:`Trajectory`."""

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

    def observe(self, reply: str, result, ids: list[int], tokenizer, im_end: int | None) -> bool:
        """An env step in both engines: :meth:`step`, then (the episode goes on) its new observation becomes the
        next input after ``ids``, the context so far. True when the episode goes on."""
        if not self.step(reply, result):
            return False
        self.pending = next_input(
            ids, {"role": "user", "content": f"Observation: {self.obs}"}, tokenizer, im_end
        )
        return True

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


def first_input(base_prompt: str, spec: EpisodeSpec, obs: str, tokenizer, tool_text: str) -> list[int]:
    """System message (env prompt, tool, experience) + the first observation, with the generation prompt."""
    system = system_message(base_prompt, spec.experience, tool_text if spec.can_ask else "")
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"Observation: {obs}"}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)[0]


def start_episodes(
    system_prompts: Mapping[str, str], specs: Sequence[EpisodeSpec], resets, tokenizer, tool_text: str
) -> list[Episode]:
    """One :class:`Episode` per spec from its reset ``(obs, info)`` (a failed reset is an infra-failed episode),
    its first input already tokenised (``system_prompts``: env id -> the env's system prompt); both engines start
    from these."""
    return [
        Episode(
            spec=s,
            info0=info,
            obs=obs,
            pending=first_input(system_prompts[s.task.env_id], s, obs, tokenizer, tool_text),
            live=not info.get("failed", False),
            infra=bool(info.get("failed", False)),
            error=info.get("error"),
        )
        for s, (obs, info) in zip(specs, resets, strict=True)
    ]


def next_input(context: list[int], message: dict, tokenizer, im_end: int | None) -> list[int]:
    """Closes the assistant turn if it stopped on a stop string (its <|im_end|> was never sampled: mask 0)
    and appends the next user / tool message with the generation prompt."""
    close = im_end is not None and (not context or context[-1] != im_end)
    cont, _ = tokenizer.encode_chat_continuation([message], add_generation_prompt=True)
    return ([im_end] if close else []) + cont


def outcome(traj: Trajectory) -> float:
    """Scalar outcome used as the RL reward: 1 on success, else the env's failure reward (ALFWorld: -1, SPEC §2;
    registered with the env, :func:`comprl_jax.envs.registry.failure_reward`)."""
    from comprl_jax.envs.registry import failure_reward

    return 1.0 if traj.success else failure_reward(traj.spec.task.env_id)
