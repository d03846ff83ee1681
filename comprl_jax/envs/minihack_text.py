"""Text rendering of NLE observations and the named-action table for the MiniHack environments.

Pure functions over numpy arrays (no NLE import), so they are cheap to test and reuse:

* ``render_map`` crops the 21x79 ``chars`` map to the bounding box of everything NetHack has shown this
  episode (the box only grows, so the frame is stable; fog of war is kept because NetHack itself only draws
  what the hero has seen or remembers).
* ``legend`` names every symbol present, from NLE's ``screen_descriptions`` (``@`` at the hero's square is "you").
* ``ACTION_NAMES`` / ``normalize_action`` map free text such as "North", "go ne", "pick up" to one canonical name.
"""

from __future__ import annotations

import re

import numpy as np

# Canonical action name -> the NLE key code it sends. Codes are NetHack's own keys (vi-keys for moves), which is
# what the ``nle.nethack.CompassDirection`` / ``Command`` enums hold; keeping ints here avoids importing NLE.
ACTION_CODES: dict[str, int] = {
    "north": ord("k"),
    "east": ord("l"),
    "south": ord("j"),
    "west": ord("h"),
    "northeast": ord("u"),
    "southeast": ord("n"),
    "southwest": ord("b"),
    "northwest": ord("y"),
    "pick up": ord(","),
    "apply": ord("a"),
    "wait": ord("."),
    "search": ord("s"),
    "kick": 4,  # ^D
    "open": ord("o"),
}
ACTION_NAMES = tuple(ACTION_CODES)
DIRECTIONS = ACTION_NAMES[:8]

# Aliases a model is likely to write; everything is lower-cased and stripped of punctuation first.
_ALIASES = {
    "n": "north",
    "e": "east",
    "s": "south",
    "w": "west",
    "ne": "northeast",
    "se": "southeast",
    "sw": "southwest",
    "nw": "northwest",
    "up": "north",
    "down": "south",
    "right": "east",
    "left": "west",
    "north east": "northeast",
    "south east": "southeast",
    "south west": "southwest",
    "north west": "northwest",
    "pickup": "pick up",
    "pick": "pick up",
    "pick up key": "pick up",
    "pick up the key": "pick up",
    "apply key": "apply",
    "use key": "apply",
    "rest": "wait",
}
_PREFIX_RE = re.compile(r"^(?:move|go|walk|step|head)\s+(?:to\s+(?:the\s+)?)?")


def normalize_action(text: str | None) -> str | None:
    """Maps an action string to its canonical name in ``ACTION_NAMES``, or None if it names no action."""
    if text is None:
        return None
    t = re.sub(r"[^a-z ]+", " ", text.lower())
    t = " ".join(t.split())
    t = _PREFIX_RE.sub("", t)
    t = _ALIASES.get(t, t)
    return t if t in ACTION_CODES else None


def bytes_to_str(arr: np.ndarray) -> str:
    """NUL-padded uint8 array -> str (latin-1 so every byte maps to one char)."""
    return bytes(np.asarray(arr, dtype=np.uint8)).split(b"\0", 1)[0].decode("latin-1")


def update_bbox(
    chars: np.ndarray, bbox: tuple[int, int, int, int] | None
) -> tuple[int, int, int, int] | None:
    """Grows ``bbox`` = (row0, row1, col0, col1), inclusive, to cover every non-blank cell of ``chars`` [21, 79]."""
    mask = chars != 32  # ord(" ")
    rows = np.flatnonzero(mask.any(axis=1))
    if rows.size == 0:
        return bbox
    cols = np.flatnonzero(mask.any(axis=0))
    box = (int(rows[0]), int(rows[-1]), int(cols[0]), int(cols[-1]))
    if bbox is None:
        return box
    return (min(bbox[0], box[0]), max(bbox[1], box[1]), min(bbox[2], box[2]), max(bbox[3], box[3]))


def render_map(chars: np.ndarray, bbox: tuple[int, int, int, int] | None) -> str:
    """The ``chars`` map [21, 79] cropped to ``bbox``; blank = unexplored (or solid rock)."""
    if bbox is None:
        return ""
    r0, r1, c0, c1 = bbox
    flat = np.asarray(chars[r0 : r1 + 1, c0 : c1 + 1], dtype=np.uint8).tobytes().decode("latin-1")
    width = c1 - c0 + 1
    return "\n".join([flat[i : i + width] for i in range(0, len(flat), width)])


# Readable names for the commonest NetHack descriptions; everything else is shown as NLE words it.
_DESC_NAMES = {
    "staircase down": "staircase down (the goal)",
    "dark part of a room": "floor of a room",
    "doorway": "doorway (open, no door)",
}


_DESC_CACHE: dict[bytes, str] = {}


def _describe(raw: bytes) -> str:
    desc = _DESC_CACHE.get(raw)
    if desc is None:
        text = raw.split(b"\0", 1)[0].decode("latin-1") or "unknown"
        desc = _DESC_NAMES.get(text, text)
        if len(_DESC_CACHE) < 4096:  # bounded: descriptions come from a finite NetHack vocabulary anyway
            _DESC_CACHE[raw] = desc
    return desc


def legend(chars: np.ndarray, descriptions: np.ndarray, bbox, hero_rc: tuple[int, int]) -> list[str]:
    """One ``"<symbol>: <meaning>"`` line per symbol present in the cropped map, ``@`` (you) first.

    Args:
      chars: [21, 79] uint8 map characters.
      descriptions: [21, 79, 80] uint8 NUL-padded ``screen_descriptions``.
      bbox: the crop (row0, row1, col0, col1), inclusive.
      hero_rc: (row, col) of the hero in map coordinates.
    """
    if bbox is None:
        return []
    r0, r1, c0, c1 = bbox
    hero_rc = (int(hero_rc[0]), int(hero_rc[1]))
    crop = np.asarray(chars[r0 : r1 + 1, c0 : c1 + 1], dtype=np.uint8)
    width, dlen = crop.shape[1], descriptions.shape[-1]
    hero_i = (hero_rc[0] - r0) * width + (hero_rc[1] - c0)
    if not (r0 <= hero_rc[0] <= r1 and c0 <= hero_rc[1] <= c1):
        hero_i = -1
    # This runs every step under the GIL: one bytes copy of the cropped descriptions, then one pass over the
    # non-blank cells collecting the distinct (symbol, raw description) pairs in first-seen order; names are
    # looked up once per pair. Same lines, in the same order, as naming every cell.
    flat_chars = crop.tobytes()
    flat_desc = np.ascontiguousarray(descriptions[r0 : r1 + 1, c0 : c1 + 1]).tobytes()
    pairs: dict[tuple[int, bytes | None], None] = {}
    for i in np.flatnonzero(crop.reshape(-1) != 32).tolist():
        pairs[(flat_chars[i], None if i == hero_i else flat_desc[i * dlen : (i + 1) * dlen])] = None
    meanings: dict[str, list[str]] = {}
    for code, raw in pairs:
        desc = "you (the player)" if raw is None else _describe(raw)
        seen = meanings.setdefault(chr(code), [])
        if desc not in seen:
            seen.append(desc)
    hero_ch = chr(int(chars[hero_rc[0], hero_rc[1]]))
    order = sorted(meanings, key=lambda ch: (ch != hero_ch, ch))
    lines = [
        f"{ch}: {' / '.join(sorted(meanings[ch], key=lambda d: d != 'you (the player)'))}" for ch in order
    ]
    lines.append("(blank): unexplored or solid rock")
    return lines


def inventory_lines(inv_strs: np.ndarray, inv_letters: np.ndarray) -> list[str]:
    """``"a: a +0 short sword (weapon in hand)"`` lines for the non-empty inventory slots."""
    out = []
    for letter, s in zip(inv_letters, inv_strs, strict=True):
        if int(letter) == 0:
            continue
        out.append(f"{chr(int(letter))}: {bytes_to_str(s)}")
    return out


def observation_text(
    message: str, map_text: str, legend_lines: list[str], inventory: list[str] | None
) -> str:
    """Assembles the observation shown to the actor."""
    parts = [f"Message: {message.strip() or '(none)'}", "Map:", map_text, "Legend:", *legend_lines]
    if inventory is not None:
        parts += ["Inventory:", *(inventory or ["(empty)"])]
    return "\n".join(parts)
