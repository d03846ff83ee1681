"""WebShop's purchase reward (Yao et al., 2022, ``web_agent_site/engine/goal.py``), re-implemented.

reward = (attribute matches + option matches + [price <= price_upper]) / (#goal attributes + #goal options + 1)
         x r_type

* Attribute match: some purchased ``Attributes`` entry has fuzzy token-set ratio > 85 with the goal attribute, or the
  goal attribute is a substring of the lowercased title, bullet points or description.
* Option match (the original ``get_option_reward``): colours of both sides normalised to the first colour word they
  contain; a goal option matches when some clicked option value has fuzzy token-set ratio > 85 with it. Nothing else:
  no substring search in the product text (so a wrong colour named in the description earns nothing) and no
  special rule for sizes (as in the original, "x-large" matches a goal "large": its tokens contain the goal's).
  Counted per goal option, so it never exceeds the number of goal options.
* r_type (product type): 1.0; 0.5 if neither the search query matches, nor >= 2 product-category levels are shared,
  nor title-noun overlap > 0.2; 0.1 if the overlap < 0.1; 0.0 if it is 0.
* Fuzzy ratio: ``rapidfuzz.fuzz.token_set_ratio`` with ``default_process`` (lowercase, non-alphanumerics to spaces),
  rounded to an integer as ``thefuzz`` (which the original calls) does.

Title nouns -- documented substitute: the original tags the titles with spaCy's ``en_core_web_lg`` and keeps NOUN /
PROPN tokens. That model is not on PyPI, so we keep the title's *content words*: lowercase alphabetic tokens of 2+
letters that are not English stop words or WebShop size/colour filler. Adjectives count as "nouns" here, so the
title overlap runs somewhat higher than the original's; buying the goal product always has overlap 1.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rapidfuzz import fuzz
from rapidfuzz.utils import default_process

from comprl_jax.envs.webshop.catalogue import Goal

FUZZY_THRESHOLD = 85

# WebShop's colour vocabulary (normalize.py): an option value is reduced to the first of these it contains.
COLOR_SET = (
    "alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown burgundy camel camo "
    "caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac copper coral cranberry cream "
    "crystal dark denim eggplant elephant espresso fuchsia gold granite grape graphite grass gray green grey heather "
    "indigo ivory ivy khaki lavender lemon leopard light lilac lime magenta maroon mauve merlot midnight mint mocha "
    "multicolor mushroom mustard natural navy nude olive orange peach pewter pink plum purple rainbow red rose royal "
    "rust sand sapphire seashell silver skull slate steel stone stonewash sunflower tan taupe teal tiger turquoise "
    "violet walnut wheat white wine yellow"
).split()

_WORD_RE = re.compile(r"[a-z]+")
_TITLE_STOP = frozenset(
    "a an and are as at be but by for from if in into is it its no not of on or such that the their then there "
    "these they this to was will with without your you our we pack pcs count oz fl inch inches ft size set piece "
    "pieces".split()
)


def normalize_color(value: str) -> str:
    """``"black forest" -> "black"``; values without a colour word are returned unchanged."""
    for color in COLOR_SET:
        if color in value:
            return color
    return value


def fuzzy(a: str, b: str) -> int:
    """thefuzz-style token-set ratio: processed strings, rounded to int."""
    return int(round(fuzz.token_set_ratio(a, b, processor=default_process)))


def title_nouns(title: str) -> list[str]:
    """The documented spaCy substitute: content words of a title (see the module docstring)."""
    return [w for w in _WORD_RE.findall(title.lower()) if len(w) >= 2 and w not in _TITLE_STOP]


def _product_text(product: Mapping[str, Any]) -> tuple[str, str, str]:
    return (
        product["Title"].lower(),
        " ".join(product["BulletPoints"]).lower(),
        product["Description"].lower(),
    )


def type_reward(product: Mapping[str, Any], goal: Goal) -> dict[str, Any]:
    query_match = product["query"] == goal.query
    bought = {x.strip() for x in product["product_category"].split("›")}
    wanted = {x.strip() for x in goal.product_category.split("›")}
    category_match = len(bought & wanted) >= 2
    desired = title_nouns(goal.name)
    overlap = len(set(title_nouns(product["Title"])) & set(desired))
    title_score = 0.2 if not desired else overlap / len(desired)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {
        "r_type": r_type,
        "query_match": query_match,
        "category_match": category_match,
        "title_score": title_score,
    }


def attribute_matches(product: Mapping[str, Any], goal: Goal) -> int:
    title, bullets, description = _product_text(product)
    matches = 0
    for attribute in goal.attributes:
        if any(fuzzy(p, attribute) > FUZZY_THRESHOLD for p in product["Attributes"]):
            matches += 1
        elif attribute in title or attribute in bullets or attribute in description:
            matches += 1
    return matches


def option_matches(goal: Goal, chosen: Mapping[str, str]) -> int:
    """How many of ``goal.options`` some clicked option value (``chosen``: name -> value) matches (see the module
    docstring); the option names play no part, as in the original."""
    purchased = [normalize_color(v) for v in chosen.values()]
    wanted = [normalize_color(o) for o in goal.options]
    return sum(any(fuzzy(p, g) > FUZZY_THRESHOLD for p in purchased) for g in wanted)


def purchase_reward(
    product: Mapping[str, Any], goal: Goal, price: float, chosen: Mapping[str, str]
) -> tuple[float, dict[str, Any]]:
    """The reward of buying ``product`` at ``price`` with the clicked options ``chosen`` (name -> value) for ``goal``.

    Returns:
        (reward in [0, 1], details: r_type, attribute/option matches, price_ok, ...)
    """
    kind = type_reward(product, goal)
    n_attr = attribute_matches(product, goal)
    n_opt = option_matches(goal, chosen)
    price_ok = price <= goal.price_upper
    total = (n_attr + n_opt + int(price_ok)) / (len(goal.attributes) + len(goal.options) + 1)
    details = dict(kind, attribute_matches=n_attr, option_matches=n_opt, price_ok=price_ok)
    return total * kind["r_type"], details
