"""Where the environment data lives, and where unpacked copies are cached.

Data root: ``$COMPRL_DATA`` if set, else ``<repo>/../shared/data`` (the offline copies described in that folder's
README). Cache root: ``$COMPRL_CACHE`` if set, else ``~/.cache/comprl_jax``. Missing data fails loudly with the
path that was looked at and how to point the project elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV_VAR = "COMPRL_DATA"
CACHE_ENV_VAR = "COMPRL_CACHE"

# comprl_jax/envs/data_paths.py -> the repository root is three levels up.
REPO_ROOT = Path(__file__).resolve().parents[2]


def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """Returns the data root: ``data_dir`` if given, else ``$COMPRL_DATA``, else ``<repo>/../shared/data``.

    Raises:
        FileNotFoundError: naming the path when the directory does not exist.
    """
    if data_dir is not None:
        root, origin = Path(data_dir), "the data_dir argument"
    elif os.environ.get(DATA_ENV_VAR):
        root, origin = Path(os.environ[DATA_ENV_VAR]), f"${DATA_ENV_VAR}"
    else:
        root, origin = REPO_ROOT.parent / "shared" / "data", "the default <repo>/../shared/data"
    root = root.expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"environment data directory {str(root)!r} (from {origin}) does not exist; "
            f"set ${DATA_ENV_VAR} or pass data_dir= to point at a folder with alfworld/ and webshop/"
        )
    return root


def data_file(*parts: str, data_dir: str | os.PathLike | None = None) -> Path:
    """Returns ``data_root(data_dir) / parts...``, raising FileNotFoundError naming the path if it is missing."""
    path = data_root(data_dir).joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"environment data file {str(path)!r} is missing; see {data_root(data_dir) / 'README.md'} "
            f"for what belongs there, or set ${DATA_ENV_VAR} / data_dir="
        )
    return path


def cache_root() -> Path:
    """Returns (and creates) the cache root: ``$COMPRL_CACHE`` or ``~/.cache/comprl_jax``."""
    root = Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "comprl_jax").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root
