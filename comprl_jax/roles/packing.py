"""Sequence packing for the updates (host side, numpy; issue 30): several episodes per row instead of one.

A row-layout batch (:func:`comprl_jax.roles.batching.pack`: one episode per row, right-padded to the bucket of the
longest) makes every row cost the longest episode's length. :func:`pack_batch` re-lays the same episodes into rows
of that same length ``L`` (so a micro-batch of ``micro_rows`` rows needs the memory it needs today), placed first-fit
decreasing, each episode whole in one row, with ``segment_ids`` (0 = padding, 1, 2, ... per segment of a row) and
its own positions (0, 1, ... per segment). The per-row arrays (advantages, subgroup, ...) become per-episode arrays
under ``batch["episodes"]`` and each token carries its episode's index (``batch["episode"]``): the losses reduce per
sequence over that index (:class:`comprl_jax.rl.losses.Episodes`), so the packed batch gives the row layout's
losses, metrics and gradients.

Static shapes: the row count is bucketed (:func:`bucket_rows`: up to ``micro_rows`` rows, a power-of-two multiple of
``row_multiple``; past it a power-of-two number of micro-batches of ``micro_rows`` rows, never more than the row
layout's), so the jitted update compiles once per (row bucket, length bucket).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from comprl_jax.rl.losses import EPISODE, EPISODES, SEGMENT_IDS


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Where each episode goes.

    Attributes:
      rows: R, the packed rows (bucketed; rows past ``used`` are padding).
      length: L, tokens per row.
      used: rows holding at least one episode.
      placement: per episode ``(row, offset)``, or None for an episode without tokens (it takes no room).
    """

    rows: int
    length: int
    used: int
    placement: tuple[tuple[int, int] | None, ...]


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[tuple[int, int] | None]:
    """Per episode ``(row, offset)``: longest first (ties: lower index first), each into the first row with room.

    Deterministic; an episode of 0 tokens gets None. Raises if one is longer than ``capacity``.
    """
    placement: list[tuple[int, int] | None] = [None] * len(lengths)
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"episode {i} has {n} tokens > the packed row length {capacity}")
        if n == 0:
            continue
        for r, used in enumerate(fill):
            if used + n <= capacity:
                placement[i] = (r, used)
                fill[r] += n
                break
        else:
            placement[i] = (len(fill), 0)
            fill.append(n)
    return placement


def bucket_rows(needed: int, micro_rows: int, max_rows: int, row_multiple: int = 1) -> int:
    """The packed row count for ``needed`` rows.

    Up to ``micro_rows``: the smallest ``row_multiple * 2^k >= needed`` (one micro-batch, capped at ``micro_rows``);
    past it: ``micro_rows`` times the smallest power of two of micro-batches that holds ``needed``, capped at
    ``ceil(max_rows / micro_rows)`` micro-batches (the row layout's count). ``row_multiple`` (the devices the batch
    is split over) must divide ``micro_rows``.
    """
    if micro_rows < 1 or micro_rows % row_multiple:
        raise ValueError(
            f"micro_rows={micro_rows} must be a positive multiple of row_multiple={row_multiple}"
        )
    if needed <= micro_rows:
        r = row_multiple
        while r < needed:
            r *= 2
        return min(r, micro_rows)
    most = -(-max_rows // micro_rows)
    m = 1
    while m * micro_rows < needed:
        m *= 2
    m = min(m, most)
    if m * micro_rows < needed:
        raise ValueError(f"{needed} packed rows exceed max_rows={max_rows}")
    return m * micro_rows


def plan(
    lengths: Sequence[int],
    length: int,
    micro_rows: int | None = None,
    max_rows: int | None = None,
    row_multiple: int = 1,
) -> PackLayout:
    """The :class:`PackLayout` of episodes of ``lengths`` in rows of ``length`` tokens (``micro_rows``: rows per
    micro-batch, default all in one; ``max_rows``: default ``len(lengths)``, the row layout's rows)."""
    placement = first_fit_decreasing(lengths, length)
    used = 1 + max((p[0] for p in placement if p is not None), default=-1)
    max_rows = max(max_rows or len(lengths), used, 1)
    micro_rows = micro_rows or -(-max_rows // row_multiple) * row_multiple
    rows = bucket_rows(used, micro_rows, max_rows, row_multiple)
    return PackLayout(rows, length, used, tuple(placement))


def pack_batch(
    batch: dict,
    micro_rows: int | None = None,
    pad_id: int = 0,
    length: int | None = None,
    row_multiple: int = 1,
    max_rows: int | None = None,
) -> dict:
    """A row-layout batch (one left-aligned episode per row) re-laid as a packed batch.

    Args:
      batch: ``[B, T]`` arrays (``tokens``, ``positions``, ``attn_mask``, ``loss_mask`` and any other per-token
        key: ``old_logprobs``, ``behaviour_logprobs``, ...), ``[B]`` per-episode arrays (``advantages``,
        ``subgroup``, ...); anything else (a scalar) is passed through. Episode b = the ``attn_mask`` tokens of
        row b, which must be a prefix of the row, and whose first token must be out of ``loss_mask``.
      micro_rows: rows per micro-batch of the update (:func:`bucket_rows`); default: one micro-batch.
      pad_id: token id of the padding.
      length: L (default: the row layout's T).
      row_multiple: the row count per micro-batch is a multiple of it (devices the batch is split over).
      max_rows: cap on the rows (default B).
    Returns:
      The packed layout of :mod:`comprl_jax.rl.losses`: the per-token keys ``[R, L]`` (padding: ``pad_id`` /
      0 / False), ``segment_ids`` and ``episode`` ``[R, L]`` int32, ``episodes``: the ``[B]`` arrays.
    """
    tokens = np.asarray(batch["tokens"])
    b, t = tokens.shape
    attn = np.asarray(batch["attn_mask"], bool)
    lengths = attn.sum(-1)
    if not np.array_equal(attn, np.arange(t)[None] < lengths[:, None]):
        raise ValueError("pack_batch needs left-aligned rows (attn_mask a prefix of each row)")
    loss = np.asarray(batch["loss_mask"])
    starts_in_loss = np.flatnonzero((lengths > 0) & (loss[:, 0] != 0))
    if starts_in_loss.size:
        raise ValueError(
            f"episodes {starts_in_loss.tolist()} have their first token in loss_mask (it has no prediction; "
            "train_batches.shift_free)"
        )
    lay = plan(lengths, length or t, micro_rows, max_rows or b, row_multiple)
    # token k of episode e -> (row, offset + k), all at once
    eps = np.asarray([e for e, p in enumerate(lay.placement) if p is not None], np.int64)
    n = lengths[eps]
    src_row = np.repeat(eps, n)
    src_col = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
    # int64 lists even when no episode is placed (np.asarray([]) would be float64 and not index)
    dst_row = np.repeat(np.asarray([lay.placement[e][0] for e in eps], np.int64), n)
    dst_col = np.repeat(np.asarray([lay.placement[e][1] for e in eps], np.int64), n) + src_col
    # segment number within the row: 1 + the episodes placed before it in that row
    seg_of = np.zeros(b, np.int32)
    last_row, s = -1, 0
    for e in sorted(eps.tolist(), key=lambda e: lay.placement[e]):
        s = s + 1 if lay.placement[e][0] == last_row else 1
        last_row, seg_of[e] = lay.placement[e][0], s

    out: dict = {}
    episodes: dict = {}
    shape = (lay.rows, lay.length)
    for key, v in batch.items():
        if not isinstance(v, np.ndarray | np.generic) and not hasattr(v, "shape"):
            out[key] = v
            continue
        v = np.asarray(v)
        if v.shape == (b, t):
            fill = pad_id if key == "tokens" else 0
            o = np.full(shape, fill, v.dtype)
            o[dst_row, dst_col] = v[src_row, src_col]
            out[key] = o
        elif v.shape == (b,):
            episodes[key] = v
        elif v.ndim == 0:
            out[key] = v
        else:
            raise ValueError(
                f"batch key {key!r} of shape {v.shape}: neither per token {(b, t)} nor per row {(b,)}"
            )
    seg = np.zeros(shape, np.int32)
    seg[dst_row, dst_col] = seg_of[src_row]
    episode = np.zeros(shape, np.int32)
    episode[dst_row, dst_col] = src_row
    out["attn_mask"] = seg > 0
    out[SEGMENT_IDS] = seg
    out[EPISODE] = episode
    out[EPISODES] = episodes
    return out


def padding_fraction(batch: dict) -> float:
    """Share of a batch's token slots that are padding (``attn_mask`` False)."""
    attn = np.asarray(batch["attn_mask"], bool)
    return float(1.0 - attn.sum() / max(attn.size, 1))
