"""ALFWorld game files: unpack the offline release once, write the minimal ``traj_data.json``, list the splits.

The offline copy (``<data>/alfworld/json_2.1.1_game.tw-pddl.tar.xz``, see the data README) is unpacked into
``<cache>/alfworld`` (atomic: a temporary folder in the same cache, renamed into place), which then has the layout of
a user's own ``$ALFWORLD_DATA`` download: ``json_2.1.1/<split>/<task dir>/<trial>/{game.tw-pddl,traj_data.json}``.
``alfworld.agents.environment.AlfredTWEnv`` only loads a game that has a ``traj_data.json`` beside it, so we write
one per game: the real fields for the 474 ``valid_*`` games (``valid_traj_data_min.json``), and for train games the
fields derived from the directory name (the data README's rule, which reproduces all 474 valid records exactly).

Game selection follows ``AlfredTWEnv.collect_game_files``: a ``traj_data.json`` with one of the six task types, no
``movable`` / ``Sliced`` in the path, a game file whose ``solvable`` flag is true. Scanning the game files for that flag
parses ~360 MB of JSON, so the listing is cached as ``games_index.json`` (beside the unpacked data, or under
``<cache>/alfworld_index/`` for a user's read-only download).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from comprl_jax.envs import data_paths

TARBALL = "json_2.1.1_game.tw-pddl.tar.xz"
VALID_TRAJ = "valid_traj_data_min.json"
RELEASE_DIR = "json_2.1.1"
SPLITS = ("train", "valid_seen", "valid_unseen", "valid_train")
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
INDEX_NAME = "games_index.json"
# The released code's training games (ComplementaryRL, roll/pipeline/agentic/env/alfworld/data/rl_train.jsonl:
# 1,466 of the 3,553 train games, listed here by "<task dir>/<trial>", in the file's order), a split of its own.
RL_TRAIN_LIST = Path(__file__).with_name("alfworld_rl_train.txt")
DERIVED_SPLITS = {"rl_train": ("train", RL_TRAIN_LIST)}  # split -> (the split it selects from, the list)
# Listed but in no split of the json_2.1.1 game release we play (no BathtubBasin task exists there): rl_train has
# 1,465 games here.
KNOWN_ABSENT = frozenset(
    {"pick_clean_then_place_in_recep-Cloth-None-BathtubBasin-413/trial_T20190908_065418_661400"}
)


def traj_data_from_dirname(task_dir: str, trial: str) -> dict:
    """The minimal ALFRED ``traj_data.json`` for a game, derived from ``task_type-Object-MRecep-Parent-scene``.

    ``look_at_obj_in_light`` is the exception: its 4th field is the lamp (``toggle_target``), ``parent_target`` empty.
    """
    fields = task_dir.split("-")
    if len(fields) != 5:
        raise ValueError(f"ALFWorld task dir {task_dir!r} is not task_type-Object-MRecep-Parent-scene")
    task_type, obj, mrecep, parent, scene = fields
    params = {
        "object_target": obj,
        "mrecep_target": "" if mrecep == "None" else mrecep,
        "parent_target": parent,
        "toggle_target": "",
        "object_sliced": False,
    }
    if task_type == "look_at_obj_in_light":
        params["toggle_target"], params["parent_target"] = parent, ""
    return {
        "task_id": trial,
        "task_type": task_type,
        "pddl_params": params,
        "scene": {"scene_num": int(scene)},
    }


def _write_traj_data(release: Path, valid_records: dict) -> None:
    for game in release.glob("*/*/*/game.tw-pddl"):
        trial_dir = game.parent
        key = "/".join(trial_dir.parts[-3:])
        record = valid_records.get(key) or traj_data_from_dirname(trial_dir.parent.name, trial_dir.name)
        (trial_dir / "traj_data.json").write_text(json.dumps(record, sort_keys=True))


def _scan(root: Path) -> dict[str, list[str]]:
    """Lists the loadable games per split as paths relative to ``root`` (sorted), the AlfredTWEnv way."""
    index = {}
    for split in SPLITS:
        split_dir = root / RELEASE_DIR / split
        games = []
        for traj in sorted(split_dir.glob("*/*/traj_data.json")):
            rel = traj.parent.relative_to(root).as_posix()
            if "movable" in rel or "Sliced" in rel:
                continue
            game = traj.parent / "game.tw-pddl"
            if not game.is_file():
                continue
            if json.loads(traj.read_text()).get("task_type") not in TASK_TYPES:
                continue
            if not json.loads(game.read_text()).get("solvable", False):
                continue
            games.append(rel + "/game.tw-pddl")
        index[split] = games
    return index


def unpack(data_dir: str | os.PathLike | None = None) -> Path:
    """Unpacks the offline ALFWorld release into ``<cache>/alfworld`` once; returns that ALFWORLD_DATA-style root.

    Safe against concurrent callers (env-pool workers): each unpacks into its own temporary folder and the first
    ``rename`` wins; the losers delete theirs.
    """
    final = data_paths.cache_root() / "alfworld"
    if (final / INDEX_NAME).is_file():
        return final
    tarball = data_paths.data_file("alfworld", TARBALL, data_dir=data_dir)
    valid_records = json.loads(data_paths.data_file("alfworld", VALID_TRAJ, data_dir=data_dir).read_text())
    tmp = Path(tempfile.mkdtemp(prefix=".alfworld-", dir=final.parent))
    try:
        with tarfile.open(tarball, "r:xz") as tar:
            tar.extractall(tmp, filter="data")  # "data" refuses absolute paths and links out of tmp
        if not (tmp / RELEASE_DIR).is_dir():
            raise FileNotFoundError(f"{tarball} does not contain a top-level {RELEASE_DIR}/ folder")
        _write_traj_data(tmp / RELEASE_DIR, valid_records)
        (tmp / INDEX_NAME).write_text(json.dumps(_scan(tmp)))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / INDEX_NAME).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_root(data_dir: str | os.PathLike | None = None) -> Path:
    """The ALFWORLD_DATA-style root to play from.

    Order: ``data_dir`` if it holds ``json_2.1.1/`` (a user's own download); else ``$ALFWORLD_DATA`` if it holds
    ``json_2.1.1/`` (``alfworld-download``'s layout); else the
    offline tarball under ``data_dir`` / ``$COMPRL_DATA`` / ``<repo>/../shared/data``, unpacked into the cache.
    """
    if data_dir is not None and (Path(data_dir) / RELEASE_DIR).is_dir():
        return Path(data_dir)
    # Importing alfworld sets $ALFWORLD_DATA to ~/.cache/alfworld when unset, so a set-but-empty one is not an error:
    # it falls through to the offline copy.
    env_root = Path(os.environ.get("ALFWORLD_DATA") or "/nonexistent").expanduser()
    if data_dir is None and (env_root / RELEASE_DIR).is_dir():
        return env_root
    return unpack(data_dir)


def list_games(root: Path, split: str) -> list[Path]:
    """Absolute ``game.tw-pddl`` paths of ``split`` under ``root`` (sorted, so the order is the same everywhere).

    ``rl_train`` (:data:`DERIVED_SPLITS`) is the train games the released code trains on; a listed game missing
    from ``root`` (other than :data:`KNOWN_ABSENT`) raises, naming how many and the first few, rather than
    shrinking the split silently.
    """
    if split in DERIVED_SPLITS:
        base, list_path = DERIVED_SPLITS[split]
        wanted = [ln.strip() for ln in list_path.read_text().splitlines() if ln.strip()]
        by_key = {"/".join(g.parts[-3:-1]): g for g in list_games(root, base)}
        missing = [k for k in wanted if k not in by_key and k not in KNOWN_ABSENT]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} of the {len(wanted)} ALFWorld games of split {split!r} ({list_path.name}) are not "
                f"loadable {base!r} games under {str(root)!r}, e.g. {missing[:3]}"
            )
        return sorted(by_key[k] for k in wanted if k in by_key)
    if split not in SPLITS:
        raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {(*SPLITS, *DERIVED_SPLITS)}")
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        digest = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:16]
        index_path = data_paths.cache_root() / "alfworld_index" / f"{digest}.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        index = _scan(root)
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, index_path)
    games = [root / rel for rel in index.get(split, [])]
    if not games:
        raise FileNotFoundError(f"no loadable ALFWorld games for split {split!r} under {str(root)!r}")
    return games
