"""The WebShop catalogue and its goals: products, seeded prices, synthetic and human goals, fixed splits.

Data (``<data>/webshop``, see the data README): ``resources_1k_documents.jsonl.xz`` (1,000 products after WebShop's
own preprocessing), ``items_ins_v2_1000.json`` (415 products carry a synthetic ``instruction`` and its
``instruction_attributes``) and ``items_human_ins_1k_subset.json`` (the 13 human instructions of this catalogue).

Seeded choices (all ``numpy.random.default_rng``, so they are the same on every machine):

* Product price: a single price is used as is; a range ``[lo, hi]`` draws ``uniform(lo, hi)`` once at load, in
  catalogue order, from ``rng(price_seed)``.
* Goal price bound (WebShop's rule): the values of 10, 20, ..., 990 above the price, first 4; with at least 2 of them,
  ``price_upper`` = the larger of 2 drawn without replacement (``rng([price_seed, catalogue index, kind])``, one draw
  per product, shared by all its goals), and the goal text ends with ", and price lower than {u:.2f} dollars";
  otherwise ``price_upper`` = 1,000,000 and no price text.
* Synthetic goals: one per option combination (option names sorted, values in catalogue order) of each of the 415
  products with an instruction: 6,910 goals, text ``"{instruction} with {name}: {value}, and ... {price text}"``.
* Splits: the synthetic goals are shuffled with ``rng(233)``; ``eval`` = the first 500, ``train`` = the other 6,410
  (as in WebShop, goals of one product can fall on both sides: they differ in options and wording of the options).
  The 13 human goals are their own set (``goals="human"``), for evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import lzma
import os
from typing import Any

import numpy as np

from comprl_jax.envs import data_paths
from comprl_jax.envs.webshop.search import SearchEngine

DOCS_FILE = "resources_1k_documents.jsonl.xz"
SYNTH_FILE = "items_ins_v2_1000.json"
HUMAN_FILE = "items_human_ins_1k_subset.json"
PRICE_STEPS = tuple(10.0 * i for i in range(1, 100))
NO_PRICE_LIMIT = 1_000_000.0
SPLIT_SEED = 233
NUM_EVAL = 500


@dataclasses.dataclass(frozen=True)
class Goal:
    """One shopping goal. ``options`` maps option name -> value (synthetic) or ``""``-keyed list (human)."""

    key: str  # stable id: "synthetic/<n>" or "human/<n>" (position in the unshuffled list)
    asin: str
    instruction: str  # the text shown to the agent, price text included
    attributes: tuple[str, ...]
    options: tuple[str, ...]  # goal option values
    price_upper: float
    query: str  # the product's search query (for the type reward)
    product_category: str
    name: str  # the product's title (for the type reward)


@dataclasses.dataclass
class Catalogue:
    products: list[dict[str, Any]]  # the ``product`` dicts, catalogue order
    asin_to_index: dict[str, int]
    prices: dict[str, float]  # asin -> drawn price
    synthetic: list[Goal]
    human: list[Goal]
    engine: SearchEngine
    splits: dict[str, list[Goal]]

    def product(self, asin: str) -> dict[str, Any]:
        return self.products[self.asin_to_index[asin.upper()]]

    def goals(self, kind: str, split: str) -> list[Goal]:
        """The goal list for ``kind`` ("synthetic" | "human") and ``split`` ("train" | "eval" | "all")."""
        if kind == "human":
            if split == "train":
                raise ValueError(
                    "the 13 WebShop human goals are an evaluation set: use split='eval' or 'all'"
                )
            return self.human
        if kind != "synthetic":
            raise ValueError(f"unknown WebShop goals {kind!r}; expected 'synthetic' or 'human'")
        if split not in self.splits:
            raise ValueError(f"unknown WebShop goal split {split!r}; expected one of {sorted(self.splits)}")
        return self.splits[split]


def draw_prices(products: list[dict[str, Any]], seed: int) -> dict[str, float]:
    """asin -> price: the single price, 100.0 when missing, or a seeded uniform draw inside a range."""
    rng = np.random.default_rng(seed)
    prices = {}
    for product in products:
        pricing = product["pricing"]
        if not pricing:
            prices[product["asin"]] = 100.0
        elif len(pricing) == 1:
            prices[product["asin"]] = float(pricing[0])
        else:
            # A few ranges are stored high-to-low; WebShop's random.uniform accepts either order.
            low, high = sorted(pricing[:2])
            prices[product["asin"]] = float(rng.uniform(low, high))
    return prices


def price_bound(price: float, rng: np.random.Generator) -> tuple[float, str]:
    """(price_upper, price text) by WebShop's rule; e.g. price 34.5 -> candidates 40, 50, 60, 70."""
    candidates = [p for p in PRICE_STEPS if p > price][:4]
    if len(candidates) < 2:
        return NO_PRICE_LIMIT, ""
    upper = float(max(rng.choice(candidates, size=2, replace=False)))
    return upper, f", and price lower than {upper:.2f} dollars"


def _synthetic_goals(products, prices, synth, seed) -> list[Goal]:
    goals = []
    for index, product in enumerate(products):
        record = synth.get(product["asin"], {})
        if not record.get("instruction"):
            continue
        upper, price_text = price_bound(prices[product["asin"]], np.random.default_rng([seed, index, 0]))
        names = sorted(product["options"])
        for combo in itertools.product(*(product["options"][n] for n in names)):
            option_text = ", and ".join(f"{n}: {v}" for n, v in zip(names, combo, strict=True))
            option_text = f" with {option_text}" if option_text else ""
            goals.append(
                Goal(
                    key=f"synthetic/{len(goals)}",
                    asin=product["asin"],
                    instruction=f"{record['instruction']}{option_text}{price_text}",
                    attributes=tuple(record["instruction_attributes"]),
                    options=tuple(combo),
                    price_upper=upper,
                    query=product["query"],
                    product_category=product["product_category"],
                    name=product["Title"],
                )
            )
    return goals


def _human_goals(products, asin_to_index, prices, human_records, seed) -> list[Goal]:
    goals = []
    for record in human_records:
        if not record.get("instruction_attributes"):
            continue  # WebShop skips human goals without attributes
        index = asin_to_index[record["asin"]]
        product = products[index]
        upper, price_text = price_bound(prices[record["asin"]], np.random.default_rng([seed, index, 1]))
        goals.append(
            Goal(
                key=f"human/{len(goals)}",
                asin=record["asin"],
                instruction=record["instruction"].strip(".") + price_text,
                attributes=tuple(record["instruction_attributes"]),
                options=tuple(record.get("instruction_options") or ()),
                price_upper=upper,
                query=product["query"],
                product_category=product["product_category"],
                name=product["Title"],
            )
        )
    return goals


@functools.lru_cache(maxsize=4)
def _load(root: str, price_seed: int) -> Catalogue:
    with lzma.open(os.path.join(root, DOCS_FILE), "rt", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f if line.strip()]
    products = [d["product"] for d in docs]
    for doc, product in zip(docs, products, strict=True):
        if doc["id"] != product["asin"]:
            raise ValueError(f"{DOCS_FILE}: document id {doc['id']!r} != product asin {product['asin']!r}")
    asin_to_index = {p["asin"]: i for i, p in enumerate(products)}
    with open(os.path.join(root, SYNTH_FILE), encoding="utf-8") as f:
        synth = json.load(f)
    with open(os.path.join(root, HUMAN_FILE), encoding="utf-8") as f:
        human_records = json.load(f)
    prices = draw_prices(products, price_seed)
    synthetic = _synthetic_goals(products, prices, synth, price_seed)
    human = _human_goals(products, asin_to_index, prices, human_records, price_seed)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(synthetic))
    shuffled = [synthetic[i] for i in order]
    splits = {"eval": shuffled[:NUM_EVAL], "train": shuffled[NUM_EVAL:], "all": synthetic}
    engine = SearchEngine([d["contents"] for d in docs])
    return Catalogue(products, asin_to_index, prices, synthetic, human, engine, splits)


def load_catalogue(data_dir: str | os.PathLike | None = None, price_seed: int = 0) -> Catalogue:
    """Loads (once per process and seed; read-only afterwards, so threads may share it) the WebShop catalogue.

    Args:
        data_dir: the data root holding ``webshop/`` (default ``$COMPRL_DATA`` or ``<repo>/../shared/data``), or a
            folder that directly holds the three WebShop files (e.g. a user's WebShop ``data/`` download).
        price_seed: seed of the price draws (product ranges and goal bounds).
    """
    if data_dir is not None and os.path.isfile(os.path.join(data_dir, DOCS_FILE)):
        root = os.fspath(data_dir)
    else:
        root = os.fspath(data_paths.data_file("webshop", data_dir=data_dir))
    for name in (DOCS_FILE, SYNTH_FILE, HUMAN_FILE):
        if not os.path.isfile(os.path.join(root, name)):
            raise FileNotFoundError(f"WebShop data file {os.path.join(root, name)!r} is missing")
    return _load(os.path.abspath(root), int(price_seed))
