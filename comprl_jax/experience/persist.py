"""Save / restore the whole experience store atomically, as JSON + ``.npy`` (never pickle).

Layout of a store directory (format ``comprl_jax.experience/1``)::

    meta.json        format, dim, configs, next uid, counters, RNG state (numpy PCG64 state dict), refine samples,
                     and per partition (key: a task id, or the shared partition) the published ScaNN index (its
                     subdirectory, or null for exact search)
    entries.json     list of entries (every field of bank.Entry), in uid order
    embeddings.npy   [N, D] float32 key embeddings, row i = entries.json[i]
    buffer.json      extractor training buffer (samples in FIFO order)
    oplog.jsonl      the ordered op log, one record per line
    index/p<i>/      ScaNN's own serialized searcher (protobuf + .npy; no docids pickle) + built_uids.npy

The directory is written under ``<path>.tmp-*`` and renamed into place (an existing store is moved aside first and
deleted after), so a crash leaves either the old or the new store. Everything is captured under the writer lock after
waiting for in-flight index builds, so a restored store answers every search exactly as the live one did at save time.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import uuid

import numpy as np

from comprl_jax.experience.bank import Entry, ExperienceBank
from comprl_jax.experience.index import BuiltIndex, load_scann, save_scann

FORMAT = "comprl_jax.experience/1"


def read_json(path: str, lines: bool = False):
    """One JSON document (``lines``: one per non-empty line) from ``path``; a missing or unreadable file raises
    naming the file (a resume then falls back to an earlier step and says which file was bad)."""
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip()] if lines else json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"experience store file {path} is missing") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"experience store file {path} is not valid JSON ({e})") from e


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def save_manager(mgr, path: str) -> None:
    """Writes ``mgr`` (an ExperienceManager) to directory ``path`` atomically."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    bank: ExperienceBank = mgr.bank
    bank.wait_for_builds()  # outside the lock: a build publishes under the writer lock
    try:
        with mgr.lock.write():
            entries = list(bank.entries.values())
            emb = (
                np.stack([bank.vector(e.uid) for e in entries])
                if entries
                else np.zeros((0, bank.dim), np.float32)
            )
            np.save(os.path.join(tmp, "embeddings.npy"), emb.astype(np.float32), allow_pickle=False)
            _write_json(os.path.join(tmp, "entries.json"), [dataclasses.asdict(e) for e in entries])
            parts = []
            for i, (task_id, ix) in enumerate(sorted(bank.indexes.items())):
                sub = None
                if ix.built is not None:
                    sub = f"index/p{i}"
                    save_scann(ix.built.searcher, os.path.join(tmp, sub))
                    np.save(os.path.join(tmp, sub, "built_uids.npy"), ix.built.uids, allow_pickle=False)
                parts.append(
                    {"task_id": task_id, "index": sub, "num_leaves": ix.built.num_leaves if sub else 0}
                )
            meta = {
                "format": FORMAT,
                "dim": bank.dim,
                "next_uid": bank.next_uid,
                "bank_counts": dict(bank.counts),
                "manager_counts": dict(mgr.counts),
                "rng_state": mgr.rng.bit_generator.state,
                "refine_samples": mgr.refine_samples,
                "num_refines": mgr.num_refines,
                "partitions": parts,
                "configs": {
                    "bank": dataclasses.asdict(bank.cfg),
                    "retrieval": dataclasses.asdict(mgr.retrieval_cfg),
                    "buffer": dataclasses.asdict(mgr.buffer.cfg),
                    "manager": dataclasses.asdict(mgr.cfg),
                },
            }
            _write_json(os.path.join(tmp, "meta.json"), meta)
            _write_json(os.path.join(tmp, "buffer.json"), mgr.buffer.state_dict())
            with open(os.path.join(tmp, "oplog.jsonl"), "w") as f:
                for rec in bank.op_log:
                    f.write(json.dumps(rec) + "\n")
        old = None
        if os.path.exists(path):
            old = f"{path}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old:
            shutil.rmtree(old)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)


def load_manager(mgr, path: str) -> None:
    """Replaces ``mgr``'s bank, buffer, RNG and counters with the store at ``path``."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no experience store at {path} (missing meta.json)")
    meta = read_json(os.path.join(path, "meta.json"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}/meta.json: unknown format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta["dim"] != mgr.bank.dim:
        raise ValueError(f"{path}: store dim {meta['dim']} != manager dim {mgr.bank.dim}")
    live = {"bank": mgr.bank.cfg, "retrieval": mgr.retrieval_cfg, "buffer": mgr.buffer.cfg}
    for name, cfg in live.items():
        mine = json.loads(json.dumps(dataclasses.asdict(cfg)))
        diff = sorted(k for k in mine if mine[k] != meta["configs"][name].get(k))
        if diff:
            raise ValueError(
                f"{path}: saved {name} config differs from this manager's in {diff} "
                "(use ExperienceManager.restore to take the saved configs)"
            )
    entries = [Entry(**d) for d in read_json(os.path.join(path, "entries.json"))]
    emb = np.load(os.path.join(path, "embeddings.npy"), allow_pickle=False)
    if emb.shape != (len(entries), mgr.bank.dim):
        raise ValueError(
            f"{path}/embeddings.npy has shape {emb.shape}, expected ({len(entries)}, {mgr.bank.dim})"
        )
    buffer_state = read_json(os.path.join(path, "buffer.json"))
    op_log = read_json(os.path.join(path, "oplog.jsonl"), lines=True)
    with mgr.lock.write():
        bank = mgr.bank
        bank.entries = collections.OrderedDict((e.uid, e) for e in entries)
        bank.indexes = {}
        by_task: dict[str, list[int]] = collections.defaultdict(list)  # partition key -> rows
        for i, e in enumerate(entries):
            by_task[bank.part(e.task_id)].append(i)
        built_dirs = {p["task_id"]: p["index"] for p in meta["partitions"]}
        for task_id in sorted(set(by_task) | set(built_dirs)):
            rows = by_task.get(task_id, [])
            ix = bank._index(task_id)
            ix.load_rows(np.array([entries[r].uid for r in rows], np.int64), emb[rows])
            sub = built_dirs.get(task_id)
            if sub is not None:
                d = os.path.join(path, sub)
                uids = np.load(os.path.join(d, "built_uids.npy"), allow_pickle=False)
                leaves = next(
                    int(p.get("num_leaves", 0)) for p in meta["partitions"] if p["task_id"] == task_id
                )
                ix.set_built(BuiltIndex(load_scann(d), uids, int(uids[-1]), leaves))
        bank.next_uid = int(meta["next_uid"])
        bank.counts = collections.Counter(meta["bank_counts"])
        bank.op_log = op_log
        mgr.counts = collections.Counter(meta["manager_counts"])
        mgr.rng.bit_generator.state = meta["rng_state"]
        # (prompt, response, token record); stores written before token records were kept have pairs.
        mgr.refine_samples = {k: (*v, None)[:3] for k, v in meta["refine_samples"].items()}
        mgr.num_refines = int(meta["num_refines"])
        mgr.buffer.load_state_dict(buffer_state)


def saved_configs(path: str) -> tuple[dict, int]:
    """The configs a store was saved with, as plain dicts (``{"bank", "retrieval", "buffer", "manager"}``; the
    manager's :func:`~comprl_jax.experience.manager.configs_from_dict` builds them), and its embedding dim."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no experience store at {path} (missing meta.json)")
    meta = read_json(os.path.join(path, "meta.json"))
    return meta["configs"], int(meta["dim"])
