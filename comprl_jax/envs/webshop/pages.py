"""The text of each WebShop page and what can be clicked on it (WebShop's "simple" text mode).

A page is the list of its visible texts, joined by `` [SEP] ``; the instruction is on every page. Clickables are the
button / link texts and the option values, as WebShop's text env lists them, in :func:`clickable_text` form.

    search   : WebShop | Instruction: | <goal> | Search                                  (search bar)
    results  : Instruction: | <goal> | Back to Search | Page p (Total results: n) | < Prev | Next > |
               <ASIN> | <title> | <price> ...                                            (10 per page of the top 50)
    item     : Instruction: | <goal> | Back to Search | < Prev | <option name> | <value> ... | <title> |
               Price: <price> | Rating: <rating> | Description | Features | Reviews | Buy Now
    sub-page : Instruction: | <goal> | Back to Search | < Prev | <description / bullet points / reviews>
    done     : Thank you for shopping with us! | Your score (min 0.0, max 1.0) | <reward>
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SEP = " [SEP] "
PER_PAGE = 10
BACK_TO_SEARCH = "back to search"
PREV = "< prev"
NEXT = "next >"
BUY = "buy now"
SUB_PAGES = ("description", "features", "reviews")


def clickable_text(text: str) -> str:
    """The form a clickable is matched in: lowercased, whitespace runs (no-break spaces included) as one space.

    ``click[...]`` arguments go through the same function, so "A1-Wine\xa0Red" is clicked as ``click[a1-wine red]``.
    """
    return " ".join(text.lower().split())


def _header(instruction: str) -> list[str]:
    return ["Instruction:", instruction]


def search_page(instruction: str) -> tuple[list[str], dict[str, tuple]]:
    return ["WebShop", *_header(instruction), "Search"], {}


def results_page(
    instruction: str, products: Sequence[Mapping[str, Any]], page: int, total: int
) -> tuple[list[str], dict[str, tuple]]:
    """``products`` are the ones on this page (at most 10); ``total`` the number of hits (at most 50)."""
    texts = [*_header(instruction), "Back to Search", f"Page {page} (Total results: {total})"]
    clickables: dict[str, tuple] = {BACK_TO_SEARCH: ("back",)}
    if page > 1:
        texts.append("< Prev")
        clickables[PREV] = ("prev",)
    if page * PER_PAGE < total:
        texts.append("Next >")
        clickables[NEXT] = ("next",)
    for product in products:
        texts += [product["asin"], product["Title"], product["Price"]]
        clickables[product["asin"].lower()] = ("product", product["asin"])
    return texts, clickables


def item_page(instruction: str, product: Mapping[str, Any]) -> tuple[list[str], dict[str, tuple]]:
    texts = [*_header(instruction), "Back to Search", "< Prev"]
    clickables: dict[str, tuple] = {BACK_TO_SEARCH: ("back",), PREV: ("prev",)}
    for name, values in product["options"].items():
        texts.append(name)
        for value in values:
            texts.append(value)
            # A value under two names: the later wins, as in WebShop.
            clickables[clickable_text(value)] = ("option", name, value)
    texts += [product["Title"], f"Price: {product['Price']}", f"Rating: {product['Rating']}"]
    texts += ["Description", "Features", "Reviews", "Buy Now"]
    for sub in SUB_PAGES:
        clickables[sub] = ("sub", sub)
    clickables[BUY] = ("buy",)
    return texts, clickables


def sub_page(instruction: str, product: Mapping[str, Any], which: str) -> tuple[list[str], dict[str, tuple]]:
    texts = [*_header(instruction), "Back to Search", "< Prev"]
    if which == "description":
        texts.append(product["Description"] or "")
    elif which == "features":
        texts += [b.strip() for b in product["BulletPoints"]]
    else:
        reviews = product.get("Reviews") or []
        if not reviews:
            texts.append("No reviews found")
        for review in reviews:
            texts += [f'"{review.get("title", "")}"', str(review.get("score", "")), review.get("body", "")]
    return [t for t in texts if t], {BACK_TO_SEARCH: ("back",), PREV: ("prev",)}


def done_page(reward: float) -> tuple[list[str], dict[str, tuple]]:
    return ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", f"{reward:.4f}"], {}


def render(texts: Sequence[str]) -> str:
    return SEP.join(t.strip() for t in texts)
