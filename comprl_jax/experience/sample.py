"""What one extractor call produced, token for token: the text the bank parses, and the training sample.

The extractor is trained off-policy (SPEC §3): a sample waits in the buffer B_phi while the extractor takes other
updates, so CISPO's importance weight ``rho = pi_phi(y) / pi_behaviour(y)`` needs the log-probabilities of the
weights that *wrote* the sample. A :class:`Generation` keeps them, together with the exact prompt ids the sampler
consumed (after any left-truncation) and the response ids it sampled: the update trains on exactly those ids and
never re-encodes decoded text.

The token record travels with the bank entry (and its op-log record, and the buffer sample) as a small JSON-able
dict: int32 / float32 arrays in base64 (exact, about 5.3 bytes per token; JSON lists of floats would not round-trip
float32 bit-for-bit without care and are 3x larger).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Generation:
    """One extractor response.

    Attributes:
      text: the decoded response (special tokens skipped): what the op parser reads.
      prompt_ids: ``[P]`` the ids the sampler was given (chat template applied, truncated as it was).
      response_ids: ``[R]`` the sampled ids, stop token included.
      logprobs: ``[R]`` log pi_behaviour of each sampled id (unmodified model distribution).
      version: extractor updates applied to the weights that produced it (staleness = now - version).
    """

    text: str
    prompt_ids: tuple[int, ...] = ()
    response_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    version: int = 0

    def __post_init__(self):
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"Generation: {len(self.logprobs)} logprobs for {len(self.response_ids)} response ids"
            )

    def record(self) -> dict[str, Any] | None:
        """The JSON-able token record (None when there are no ids: a text-only extractor_fn, as in tests)."""
        if not self.response_ids and not self.prompt_ids:
            return None
        return {
            "prompt_ids": _b64(np.asarray(self.prompt_ids, "<i4")),
            "response_ids": _b64(np.asarray(self.response_ids, "<i4")),
            "logprobs": _b64(np.asarray(self.logprobs, "<f4")),
            "version": int(self.version),
        }


def text_of(g: str | Generation) -> str:
    """An extractor_fn may return plain strings (tests, simple callables) or :class:`Generation`s."""
    return g.text if isinstance(g, Generation) else str(g)


def record_of(g: str | Generation) -> dict[str, Any] | None:
    return g.record() if isinstance(g, Generation) else None


@dataclasses.dataclass(frozen=True)
class TokenSample:
    """A decoded token record: ``ids = prompt + response``; ``mask`` / ``logprobs`` are aligned with ``ids``."""

    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    version: int


def decode_record(rec: dict[str, Any]) -> TokenSample:
    prompt = np.frombuffer(_unb64(rec["prompt_ids"]), "<i4")
    resp = np.frombuffer(_unb64(rec["response_ids"]), "<i4")
    lps = np.frombuffer(_unb64(rec["logprobs"]), "<f4")
    if len(lps) != len(resp):
        raise ValueError(f"token record: {len(lps)} logprobs for {len(resp)} response ids")
    return TokenSample(
        ids=prompt.tolist() + resp.tolist(),
        mask=[0] * len(prompt) + [1] * len(resp),
        logprobs=[0.0] * len(prompt) + lps.astype(np.float32).tolist(),
        version=int(rec["version"]),
    )


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode("ascii"), validate=True)


def texts(gens: Sequence[str | Generation]) -> list[str]:
    return [text_of(g) for g in gens]
