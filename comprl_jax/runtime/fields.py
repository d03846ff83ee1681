"""Config sections as dataclasses (issue 29): a section of the run config **is** its dataclass's arguments, as
big_vision builds ``Model(**config.model)``, so a key has one name from the command line to the code and its value
is checked once, in the ``__post_init__`` of the class that uses it.

:func:`from_section` builds a dataclass from a section (a ``ConfigDict`` or a dict): unknown keys, and fields the
class derives itself (its ``DERIVED`` map: field -> where the value comes from), are refused; nested dataclass fields
are built from their sub-sections; a :class:`FieldError` raised by ``__post_init__`` comes back as a ValueError naming
the dotted config key (``config key retrieval.candidates: must be >= retrieval.k, got 0``).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


class FieldError(ValueError):
    """A bad value of one field of a config dataclass; :func:`from_section` turns ``field`` into the config key."""

    def __init__(self, field: str, reason: str, value: Any):
        # ``{section}`` in a reason (naming a sibling key) becomes the section's config key in from_section
        super().__init__(f"{field} {reason.replace('{section}.', '')}, got {value!r}")
        self.field, self.reason, self.value = field, reason, value


def check(cond: bool, field: str, reason: str, value: Any) -> None:
    """Raises :class:`FieldError` unless ``cond`` (for ``__post_init__``)."""
    if not cond:
        raise FieldError(field, reason, value)


def _keys(section) -> list[str]:
    return list(section.keys())


def from_section(cls, section, key: str, **extra):
    """``cls(**section, **extra)``; ``key`` is the section's dotted config key (for errors).

    Args:
      cls: a dataclass whose init fields name the section's keys.
      section: ``ConfigDict`` / dict (an instance of ``cls`` passes through, with ``extra`` replaced).
      extra: fields the code decides (not config keys), e.g. a seed or an index setting.
    """
    if isinstance(section, cls):
        return dataclasses.replace(section, **extra) if extra else section
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    derived = getattr(cls, "DERIVED", {})
    given = {k: section[k] for k in _keys(section)}
    bad = sorted(k for k in given if k not in fields or k in derived or k in extra)
    if bad:
        why = "; ".join(
            f"{k} comes from {derived[k]}" if k in derived else f"{k} is set by the code"
            for k in bad
            if k in derived or k in extra
        )
        settable = sorted(fields - set(derived) - set(extra))
        names = ", ".join(f"{key}.{k}" for k in bad)
        raise ValueError(
            f"config key {names}: unknown{f' ({why})' if why else ''}; {cls.__name__} takes {settable}"
        )
    hints = typing.get_type_hints(cls)
    for name, value in given.items():
        t = hints.get(name)
        if dataclasses.is_dataclass(t) and not isinstance(value, t):
            given[name] = from_section(t, value, f"{key}.{name}")
        elif typing.get_origin(t) is tuple and isinstance(value, list):
            given[name] = tuple(value)
    try:
        return cls(**given, **extra)
    except FieldError as e:
        reason = e.reason.replace("{section}", key)
        raise ValueError(f"config key {key}.{e.field}: {reason}, got {e.value!r}") from None
