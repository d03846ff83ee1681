"""Periodic merge (SPEC §4): a sliding pass over each partition in chunks of 5 with carry-over.

For one partition, with originals o1..on in FIFO order and chunk size C:
chunk 1 = o1..oC. If the extractor rewrites it into merged items, the chunk's entries are replaced by them and the
last (at most C-1) merged items are *carried*: chunk 2 = carried + the next C - len(carried) originals, and so on.
If the output is "return", unparsable, or has any rejected op, the chunk is left as it is and nothing is carried.
Partitions are independent, so one extractor call per round serves every partition still walking (batched prompts).
Entries removed concurrently while the extractor runs are skipped; merged entries record the merge call as their
training sample (kind "merge").
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np

from comprl_jax.experience.bank import ExperienceBank
from comprl_jax.experience.ops import merge_prompt, parse_ops


def next_chunk(carry: Sequence[int], originals: Sequence[int], pos: int, size: int) -> tuple[list[int], int]:
    """The next chunk (carried uids first) and the new position in ``originals``."""
    take = max(1, size - len(carry))
    return list(carry) + list(originals[pos : pos + take]), pos + take


def merged_items(
    response: str, chunk_len: int, max_chars: int
) -> tuple[list[str] | None, collections.Counter]:
    """Merged lesson texts from a merge response, or None when the chunk must be kept (return / invalid output)."""
    res = parse_ops(response, chunk_len, max_chars)
    if res.rejected or not res.ops:
        return None, res.rejected
    return [op.new_memory for op in res.ops], res.rejected


def merge_bank(
    bank: ExperienceBank,
    embed_fn: Callable[[list[str]], np.ndarray],
    extractor_fn: Callable[[list[str]], list[str]],
    step: int,
    chunk_size: int = 5,
) -> dict:
    """Runs one merge pass over every partition; returns counters (chunks, merged, kept, removed, added)."""
    stats: collections.Counter = collections.Counter()
    with bank.lock.read():
        walks = {t: {"orig": bank.partition(t), "pos": 0, "carry": []} for t in sorted(bank.indexes)}
    walks = {t: w for t, w in walks.items() if len(w["orig"]) > 1}
    max_chars = bank.cfg.max_entry_chars
    while walks:
        tasks, chunks, prompts = [], [], []
        with bank.lock.read():
            for t, w in list(walks.items()):
                if w["pos"] >= len(w["orig"]):
                    del walks[t]
                    continue
                chunk, w["pos"] = next_chunk(w["carry"], w["orig"], w["pos"], chunk_size)
                chunk = [u for u in chunk if u in bank.entries]
                if len(chunk) < 2:  # nothing to merge with; whatever is left stays as it is
                    w["carry"] = []
                    continue
                tasks.append(t)
                chunks.append(chunk)
                prompts.append(merge_prompt([bank.entries[u].text for u in chunk], max_chars))
        if not prompts:
            continue
        responses = list(extractor_fn(prompts))
        if len(responses) != len(prompts):
            raise ValueError(f"extractor_fn returned {len(responses)} responses for {len(prompts)} prompts")
        for t, chunk, prompt, response in zip(tasks, chunks, prompts, responses, strict=True):
            stats["chunks"] += 1
            items, rejected = merged_items(response, len(chunk), max_chars)
            stats.update({f"rejected_{k}": v for k, v in rejected.items()})
            if items is None:
                stats["kept"] += 1
                walks[t]["carry"] = []
                continue
            vecs = np.asarray(embed_fn(items), np.float32)
            with bank.lock.write():
                for u in chunk:
                    if u in bank.entries:
                        bank.remove(u, "merge")
                        stats["removed"] += 1
                added = [
                    bank.add(t, text, v, step=step, prompt=prompt, response=response, kind="merge")
                    for text, v in zip(items, vecs, strict=True)
                ]
            stats["merged"] += 1
            stats["added"] += len(added)
            walks[t]["carry"] = added[-(chunk_size - 1) :] if chunk_size > 1 else []
    return dict(stats)
