"""Extractor training buffer B_phi (SPEC §3, Eq. 7).

A sample is one extractor call (prompt, response), keyed by the call: ``"call:<id>"`` for a distillation, merge or
seed call (every entry that call wrote shares it: one call is one sample, as the released code keys samples by
``request_id``), ``"refine:<n>"`` for a search-and-ask answer, ``"entry:<uid>"`` for an entry of a store from before
call ids. Every guided trajectory that used any of the call's entries adds r = +1 (success) or -1 (failure) to the
*same* sample, once per trajectory, whose reward is the mean; a sample keeps accumulating while it waits. While the
buffer holds ``batch_size`` samples the oldest ``batch_size`` are popped (FIFO by first reward; the trainer pops
every full batch, one extractor update each); the update's advantages are ``r_i - mean(r)`` over the batch, times
the count-aware weight of Eq. 7. ``t`` is the trainer (pipeline) step of the update, ``t_last`` the step of the
update that last trained the sample and ``c_train`` how many updates have (the released code's ``global_step`` /
``last_trained_step``, ``roll/pipeline/agentic/multi_agentic_pipeline.py``, ``_build_memory_batch_from_buffer_entries``)::

    w(m) = 1                                                      never trained
           0                                                      if t - t_last < delta            (cooldown)
           (1 + c_train) ** -alpha * (1 - exp(-(t - t_last) / tau))   otherwise

The paper: the reweighting "discounts experiences according to cumulative training count and recency, while
cooldown suppresses repeated short-window updates". The count factor is the released code's; the recency factor
grows back towards 1 as the sample rests (``tau``, in trainer steps; ``tau = 0`` drops it, i.e. count only).
With ``delta = 1`` (default, the released MiniHack config) a sample trained earlier in the same step sits out. The
trainer records every outcome of a step before its first pop, so a popped sample can only come back in a later step
and ``delta = 1`` never silences one there (nor in the released pipeline, one update per step); ``delta >= 2``
makes a sample sit out whole steps.

After the update the caller reports it with :meth:`ExtractorBuffer.trained_keys` (the samples with ``w > 0``), and
the manager bumps ``c_train`` / sets ``t_last`` on the bank entries of those samples.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from comprl_jax.runtime.fields import check


@dataclasses.dataclass
class Sample:
    key: str
    prompt: str
    response: str
    reward_sum: float = 0.0
    count: int = 0
    train_count: int = 0
    last_trained: int | None = None
    tokens: dict | None = None  # ids + behaviour logprobs (experience.sample); None: re-encode the text

    @property
    def reward(self) -> float:
        return self.reward_sum / self.count


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """Config section ``extractor.buffer``: the extractor's training buffer (SPEC §3, Eq. 7).

    Attributes:
      batch_size: samples per extractor update (the buffer pops a batch when it holds this many).
      cooldown: Eq. 7 delta, in trainer steps (1 = never twice in one step; the released code's).
      alpha: Eq. 7 count discount ``(1 + c_train)^-alpha``.
      recency_tau: Eq. 7 recency factor ``1 - exp(-(t - t_last)/tau)``, in trainer steps (0 = off).
    """

    batch_size: int = 64
    cooldown: int = 1
    alpha: float = 0.5
    recency_tau: float = 2.0

    def __post_init__(self):
        check(self.batch_size >= 1, "batch_size", "must be >= 1", self.batch_size)
        check(self.cooldown >= 0, "cooldown", "must be >= 0 (trainer steps)", self.cooldown)
        check(self.alpha >= 0, "alpha", "must be >= 0", self.alpha)
        check(self.recency_tau >= 0, "recency_tau", "must be >= 0 (0 = no recency factor)", self.recency_tau)


@dataclasses.dataclass
class ExtractorBatch:
    """One popped batch. Arrays are [B]; ``weights`` are Eq. 7's (the update's loss applies them to
    ``rl.advantages.extractor_advantages(rewards)``); ``step`` is the trainer step (t) of its update; ``tokens[i]``
    is sample i's token record or None."""

    keys: list[str]
    prompts: list[str]
    responses: list[str]
    rewards: np.ndarray
    weights: np.ndarray
    step: int
    tokens: list = dataclasses.field(default_factory=list)


def count_aware_weights(
    train_counts, last_trained, step: int, cooldown: int, alpha: float, recency_tau: float = 0.0
) -> np.ndarray:
    """Eq. 7 weights [B] float32 for an update in trainer step ``step`` (t); ``last_trained`` entries are the step
    of the update that last trained each sample (None = never: weight 1)."""
    from comprl_jax.rl.advantages import (
        count_aware_weight,  # the formula lives once, beside the other advantages
    )

    since = np.array([np.inf if t is None else step - t for t in last_trained], np.float32)
    w = count_aware_weight(np.asarray(train_counts, np.float32), since, alpha, cooldown, recency_tau)
    return np.asarray(w, np.float32).reshape(len(since))


class ExtractorBuffer:
    """FIFO of shared samples. Not thread-safe: the manager calls it under its writer lock."""

    def __init__(self, cfg: BufferConfig = BufferConfig()):
        self.cfg = cfg
        self.samples: collections.OrderedDict[str, Sample] = collections.OrderedDict()
        self.num_popped = 0

    def __len__(self) -> int:
        return len(self.samples)

    def add_reward(
        self,
        key: str,
        reward: float,
        prompt: str | None = None,
        response: str | None = None,
        train_count: int = 0,
        last_trained: int | None = None,
        tokens: dict | None = None,
    ) -> bool:
        """Adds one trajectory's reward to ``key``'s sample, creating it (needs prompt/response) if absent.

        Returns False (nothing recorded) when the sample is new and no prompt/response is given.
        """
        s = self.samples.get(key)
        if s is None:
            if prompt is None or response is None:
                return False
            s = self.samples[key] = Sample(
                key, prompt, response, train_count=train_count, last_trained=last_trained, tokens=tokens
            )
        s.reward_sum += float(reward)
        s.count += 1
        return True

    def pop_batch(self, step: int) -> ExtractorBatch | None:
        """Pops the oldest ``batch_size`` samples for an update in trainer step ``step`` when enough are waiting,
        else returns None."""
        b = self.cfg.batch_size
        if len(self.samples) < b:
            return None
        popped = [self.samples.popitem(last=False)[1] for _ in range(b)]
        self.num_popped += b
        rewards = np.array([s.reward for s in popped], np.float32)
        weights = count_aware_weights(
            [s.train_count for s in popped],
            [s.last_trained for s in popped],
            step,
            self.cfg.cooldown,
            self.cfg.alpha,
            self.cfg.recency_tau,
        )
        return ExtractorBatch(
            [s.key for s in popped],
            [s.prompt for s in popped],
            [s.response for s in popped],
            rewards,
            weights,
            int(step),
            [s.tokens for s in popped],
        )

    @staticmethod
    def trained_keys(batch: ExtractorBatch) -> list[str]:
        """Keys whose ``c_train`` / ``t_last`` advance after the update: those with w > 0."""
        return [k for k, w in zip(batch.keys, batch.weights, strict=True) if w > 0]

    def state_dict(self) -> dict:
        return {
            "samples": [dataclasses.asdict(s) for s in self.samples.values()],
            "num_popped": self.num_popped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.samples = collections.OrderedDict((d["key"], Sample(**d)) for d in state["samples"])
        self.num_popped = int(state["num_popped"])
