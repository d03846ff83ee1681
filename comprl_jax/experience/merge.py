"""Periodic merge (SPEC §4): a sliding pass over each partition in chunks of 5 with carry-over.

For one partition, with originals o1..on in FIFO order and chunk size C:
chunk 1 = o1..oC. If the extractor rewrites it into merged items, the chunk's entries are replaced by them and the
last (at most C-1) merged items are *carried*: chunk 2 = carried + the next C - len(carried) originals, and so on.
If the output is "return", unparsable, or has any rejected op, the chunk is left as it is and nothing is carried.
Partitions are independent, so one extractor call per round serves every partition still walking (batched prompts).
Entries removed concurrently while the extractor runs are skipped; merged entries record the merge call as their
training sample (kind "merge", with the call's token ids and behaviour logprobs when the extractor returns a
:class:`~comprl_jax.experience.sample.Generation`).

Keys follow ``bank.key`` as for added entries: the merged text itself (``"content"``), or, for ``"query"``, the
distinct queries the chunk's originals were keyed by, joined (the merged lesson stands for all their situations).
A merged entry records the task id of its originals, or ``MIXED_TASKS`` when a shared partition merged lessons
of several tasks.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np

from comprl_jax.experience.bank import ExperienceBank
from comprl_jax.experience.ops import merge_prompt, parse_ops
from comprl_jax.experience.sample import record_of, text_of

MIXED_TASKS = "<mixed>"


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
    embed_keys: Callable[[list[str], bool], list[np.ndarray]],
    extractor_fn: Callable[[list[str]], list],
    step: int,
    chunk_size: int = 5,
) -> dict:
    """Runs one merge pass over every partition; returns counters (chunks, merged, kept, removed, added).

    ``embed_keys(texts, query)`` embeds key texts (``query=True``: with the query embedder), as
    :meth:`~comprl_jax.experience.manager.ExperienceManager.embed_keys`.
    """
    stats: collections.Counter = collections.Counter()
    with bank.lock.read():
        walks = {p: {"orig": bank.partition(p), "pos": 0, "carry": []} for p in sorted(bank.indexes)}
    walks = {p: w for p, w in walks.items() if len(w["orig"]) > 1}
    max_chars = bank.cfg.max_entry_chars
    while walks:
        parts, tasks, chunks, prompts, keys = [], [], [], [], []
        with bank.lock.read():
            for p, w in list(walks.items()):
                if w["pos"] >= len(w["orig"]):
                    del walks[p]
                    continue
                chunk, w["pos"] = next_chunk(w["carry"], w["orig"], w["pos"], chunk_size)
                chunk = [u for u in chunk if u in bank.entries]
                if len(chunk) < 2:  # nothing to merge with; whatever is left stays as it is
                    w["carry"] = []
                    continue
                owners = {bank.entries[u].task_id for u in chunk}
                parts.append(p)
                tasks.append(owners.pop() if len(owners) == 1 else MIXED_TASKS)
                chunks.append(chunk)
                keys.append("\n".join(dict.fromkeys(bank.entries[u].key_text for u in chunk)))
                prompts.append(merge_prompt([bank.entries[u].text for u in chunk], max_chars))
        if not prompts:
            continue
        responses = list(extractor_fn(prompts))
        if len(responses) != len(prompts):
            raise ValueError(f"extractor_fn returned {len(responses)} responses for {len(prompts)} prompts")
        for p, t, chunk, prompt, gen, key in zip(parts, tasks, chunks, prompts, responses, keys, strict=True):
            stats["chunks"] += 1
            response = text_of(gen)
            items, rejected = merged_items(response, len(chunk), max_chars)
            stats.update({f"rejected_{k}": v for k, v in rejected.items()})
            if items is None:
                stats["kept"] += 1
                walks[p]["carry"] = []
                continue
            by_query = bank.cfg.key == "query"
            key_texts = [key] * len(items) if by_query else items
            vecs = embed_keys(key_texts, by_query)
            with bank.lock.write():
                for u in chunk:
                    if u in bank.entries:
                        bank.remove(u, "merge")
                        stats["removed"] += 1
                call = bank.new_call()  # the merge call is one training sample for every entry it wrote
                added = [
                    bank.add(
                        t,
                        text,
                        v,
                        step=step,
                        key_text=kt,
                        prompt=prompt,
                        response=response,
                        kind="merge",
                        tokens=record_of(gen),
                        call=call,
                    )
                    for text, kt, v in zip(items, key_texts, vecs, strict=True)
                ]
            stats["merged"] += 1
            stats["added"] += len(added)
            walks[p]["carry"] = added[-(chunk_size - 1) :] if chunk_size > 1 else []
    return dict(stats)
