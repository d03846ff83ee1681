"""Packing variable-length token sequences into fixed, bucketed training batches (host side, numpy).

The trainer hands the RL update exactly the tokens the sampler produced: per sequence a list of token ids and a
same-length 0/1 mask of the tokens the model generated (assistant tokens of every turn). Packing pads on the right
to a bucketed length so the jitted update compiles once per bucket. With ``{role}.pack`` the update re-lays these rows
into shared rows of the same length (:mod:`comprl_jax.roles.packing`) before each optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bucket(n: int, minimum: int = 64, maximum: int | None = None) -> int:
    """Smallest power of two >= n (at least ``minimum``); raises past ``maximum`` (config max_context)."""
    b = minimum
    while b < n:
        b *= 2
    if maximum is not None and n > maximum:
        raise ValueError(f"sequence of {n} tokens exceeds the configured max context {maximum}")
    return b if maximum is None else min(b, max(maximum, minimum))


def pack(
    sequences: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    pad_id: int,
    length: int | None = None,
    rows: int | None = None,
    logprobs: Sequence[Sequence[float]] | None = None,
) -> dict[str, np.ndarray]:
    """Right-pads sequences into a batch.

    Args:
      sequences: B token-id lists.
      loss_masks: B lists of 0/1, same lengths as ``sequences``.
      pad_id: filler id.
      length: T (default: bucket of the longest).
      rows: pad the batch to this many rows with empty (all-masked) rows, for a fixed micro-batch split.
      logprobs: optional B lists aligned with ``sequences`` (the sampler's behaviour log-probabilities).
    Returns:
      ``tokens [R, T] int32``, ``positions [R, T] int32``, ``attn_mask [R, T] bool``, ``loss_mask [R, T] float32``,
      ``row_valid [R] bool``, and with ``logprobs`` also ``behaviour_logprobs [R, T] float32``.
    """
    if len(sequences) != len(loss_masks):
        raise ValueError(f"{len(sequences)} sequences but {len(loss_masks)} loss masks")
    longest = max((len(s) for s in sequences), default=1)
    T = length or bucket(longest)
    R = rows or len(sequences)
    if R < len(sequences):
        raise ValueError(f"rows={R} < {len(sequences)} sequences")
    tokens = np.full((R, T), pad_id, np.int32)
    attn = np.zeros((R, T), bool)
    loss = np.zeros((R, T), np.float32)
    lps = np.zeros((R, T), np.float32) if logprobs is not None else None
    if logprobs is not None and len(logprobs) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(logprobs)} logprob lists")
    for i, (s, m) in enumerate(zip(sequences, loss_masks, strict=False)):
        if len(s) != len(m):
            raise ValueError(f"sequence {i}: {len(s)} tokens but a loss mask of {len(m)}")
        if len(s) > T:
            raise ValueError(f"sequence {i} has {len(s)} tokens > batch length {T}")
        tokens[i, : len(s)] = s
        attn[i, : len(s)] = True
        loss[i, : len(s)] = m
        if lps is not None:
            if len(logprobs[i]) != len(s):
                raise ValueError(f"sequence {i}: {len(s)} tokens but {len(logprobs[i])} logprobs")
            lps[i, : len(s)] = logprobs[i]
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (R, T)).copy()
    row_valid = np.zeros((R,), bool)
    row_valid[: len(sequences)] = True
    out = {
        "tokens": tokens,
        "positions": positions,
        "attn_mask": attn,
        "loss_mask": loss,
        "row_valid": row_valid,
    }
    if lps is not None:
        out["behaviour_logprobs"] = lps
    return out
