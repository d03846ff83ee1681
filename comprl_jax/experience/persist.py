"""Save / restore the whole experience store atomically, as JSON + ``.npy`` (never pickle).

Layout of a store directory (format ``comprl_jax.experience/1``)::

    meta.json        format, dim, configs, next uid and call id, counters, RNG state (numpy PCG64 state dict),
                     refine samples, and per partition (key: a task id, or the shared partition) the published ScaNN index (its
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

import json
import os
import shutil
import uuid

import numpy as np

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
    """Writes ``mgr.state_dict()`` (an ExperienceManager's) to directory ``path`` atomically."""
    path = os.path.abspath(path)
    state = mgr.state_dict()  # a consistent copy: the writing below needs no lock
    bank = state["bank"]
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        np.save(os.path.join(tmp, "embeddings.npy"), bank["embeddings"], allow_pickle=False)
        _write_json(os.path.join(tmp, "entries.json"), bank["entries"])
        parts = []
        for i, p in enumerate(bank["partitions"]):
            built, sub = p["built"], None
            if built is not None:
                sub = f"index/p{i}"
                save_scann(built.searcher, os.path.join(tmp, sub))
                np.save(os.path.join(tmp, sub, "built_uids.npy"), built.uids, allow_pickle=False)
            parts.append(
                {"task_id": p["task_id"], "index": sub, "num_leaves": built.num_leaves if sub else 0}
            )
        meta = {
            "format": FORMAT,
            "dim": state["dim"],
            "next_uid": bank["next_uid"],
            "next_call": bank["next_call"],
            "bank_counts": bank["counts"],
            "manager_counts": state["counts"],
            "rng_state": state["rng_state"],
            "refine_samples": state["refine_samples"],
            "num_refines": state["num_refines"],
            "partitions": parts,
            "configs": state["configs"],
        }
        _write_json(os.path.join(tmp, "meta.json"), meta)
        _write_json(os.path.join(tmp, "buffer.json"), state["buffer"])
        with open(os.path.join(tmp, "oplog.jsonl"), "w") as f:
            for rec in bank["op_log"]:
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


def read_state(path: str) -> dict:
    """The store at ``path`` as an ``ExperienceManager.state_dict()`` (files checked, errors name the file)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no experience store at {path} (missing meta.json)")
    meta = read_json(os.path.join(path, "meta.json"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}/meta.json: unknown format {meta.get('format')!r}, expected {FORMAT!r}")
    entries = read_json(os.path.join(path, "entries.json"))
    emb = np.load(os.path.join(path, "embeddings.npy"), allow_pickle=False)
    if emb.shape != (len(entries), meta["dim"]):
        raise ValueError(
            f"{path}/embeddings.npy has shape {emb.shape}, expected ({len(entries)}, {meta['dim']})"
        )
    partitions = []
    for p in meta["partitions"]:
        built = None
        if p["index"] is not None:
            d = os.path.join(path, p["index"])
            uids = np.load(os.path.join(d, "built_uids.npy"), allow_pickle=False)
            built = BuiltIndex(load_scann(d), uids, int(uids[-1]), int(p.get("num_leaves", 0)))
        partitions.append({"task_id": p["task_id"], "built": built})
    return {
        "dim": meta["dim"],
        "configs": meta["configs"],
        "bank": {
            "entries": entries,
            "embeddings": emb,
            "next_uid": meta["next_uid"],
            **({"next_call": meta["next_call"]} if "next_call" in meta else {}),  # absent before call ids
            "counts": meta["bank_counts"],
            "op_log": read_json(os.path.join(path, "oplog.jsonl"), lines=True),
            "partitions": partitions,
        },
        "buffer": read_json(os.path.join(path, "buffer.json")),
        "counts": meta["manager_counts"],
        "rng_state": meta["rng_state"],
        "refine_samples": meta["refine_samples"],
        "num_refines": meta["num_refines"],
    }


def load_manager(mgr, path: str) -> None:
    """Replaces ``mgr``'s bank, buffer, RNG and counters with the store at ``path``."""
    state = read_state(path)
    try:
        mgr.load_state_dict(state)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def saved_configs(path: str) -> tuple[dict, int]:
    """The configs a store was saved with, as plain dicts (``{"bank", "retrieval", "buffer", "manager"}``; the
    manager's :func:`~comprl_jax.experience.manager.configs_from_dict` builds them), and its embedding dim."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no experience store at {path} (missing meta.json)")
    meta = read_json(os.path.join(path, "meta.json"))
    return meta["configs"], int(meta["dim"])
