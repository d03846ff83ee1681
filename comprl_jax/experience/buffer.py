"""Extractor training buffer B_phi (SPEC §3, Eq. 7).

A sample is an extractor call (prompt, response) keyed by what it produced: ``"entry:<uid>"`` for a bank entry,
``"refine:<n>"`` for a search-and-ask answer. Every guided trajectory that used the entry adds r = +1 (success) or -1
(failure) to the *same* sample, whose reward is the mean; a sample keeps accumulating while it waits. When the buffer
holds ``batch_size`` samples the oldest ``batch_size`` are popped (FIFO by first reward), advantages are
``r_i - mean(r)`` over the batch, multiplied by the count-aware weight of Eq. 7::

    w(m) = 0                          if t - t_last(m) < delta   (cooldown)
           (1 + c_train(m)) ** -alpha otherwise

After the update the caller reports it with :meth:`ExtractorBuffer.mark_trained`, which bumps ``c_train`` and sets
``t_last`` for the samples with ``w > 0`` (the manager mirrors this onto bank entries).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass
class Sample:
    key: str
    prompt: str
    response: str
    reward_sum: float = 0.0
    count: int = 0
    train_count: int = 0
    last_trained: int | None = None

    @property
    def reward(self) -> float:
        return self.reward_sum / self.count


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    batch_size: int = 64
    cooldown: int = 1  # delta of Eq. 7, in extractor steps
    alpha: float = 0.5


@dataclasses.dataclass
class ExtractorBatch:
    """One popped batch. Arrays are [B]; ``advantages`` already include the Eq. 7 weights."""

    keys: list[str]
    prompts: list[str]
    responses: list[str]
    rewards: np.ndarray
    weights: np.ndarray
    advantages: np.ndarray
    step: int


def count_aware_weights(train_counts, last_trained, step: int, cooldown: int, alpha: float) -> np.ndarray:
    """Eq. 7 weights [B] float32; ``last_trained`` entries are None for samples never trained."""
    w = np.power(1.0 + np.asarray(train_counts, np.float64), -alpha)
    cool = np.array([t is not None and step - t < cooldown for t in last_trained], bool)
    return np.where(cool, 0.0, w).astype(np.float32)


def batch_advantages(rewards: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Â_i = w_i * (r_i - mean_j r_j), [B] float32 (no std normalisation, SPEC §3)."""
    rewards = np.asarray(rewards, np.float64)
    return (np.asarray(weights, np.float64) * (rewards - rewards.mean())).astype(np.float32)


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
    ) -> bool:
        """Adds one trajectory's reward to ``key``'s sample, creating it (needs prompt/response) if absent.

        Returns False (nothing recorded) when the sample is new and no prompt/response is given.
        """
        s = self.samples.get(key)
        if s is None:
            if prompt is None or response is None:
                return False
            s = self.samples[key] = Sample(
                key, prompt, response, train_count=train_count, last_trained=last_trained
            )
        s.reward_sum += float(reward)
        s.count += 1
        return True

    def pop_batch(self, step: int) -> ExtractorBatch | None:
        """Pops the oldest ``batch_size`` samples when enough are waiting, else returns None."""
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
        )
        return ExtractorBatch(
            [s.key for s in popped],
            [s.prompt for s in popped],
            [s.response for s in popped],
            rewards,
            weights,
            batch_advantages(rewards, weights),
            int(step),
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
