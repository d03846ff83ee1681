"""WebShop as a :class:`TextEnv`: find and buy the product a shopping instruction describes.

Each reset picks a goal by seed (``seed % n`` into the split's fixed, shuffled goal list; see ``catalogue``) and opens
the search page. Actions: ``search[keywords]`` (only on the search page, which has the search bar) and
``click[text]`` (only a clickable of the current page; case and runs of whitespace do not matter). Anything else -- no
``<answer>``, an unknown verb, a search without a search bar, a click on text that is not clickable -- changes nothing
on the page, scores 0, is counted as invalid, and the next observation starts with a line saying why. ``click[buy now]`` ends the episode with the purchase reward (``reward.purchase_reward``); success means
reward 1.0. Running out of turns ends it with reward 0.
"""

from __future__ import annotations

import os
import re
from typing import Any

from comprl_jax.envs.base import TextEnv, echo
from comprl_jax.envs.webshop import pages
from comprl_jax.envs.webshop.catalogue import Goal, load_catalogue
from comprl_jax.envs.webshop.reward import purchase_reward

_ACTION_RE = re.compile(r"^(search|click)\s*\[(.*)\]$", re.DOTALL | re.IGNORECASE)
SEARCH_PLACEHOLDER = "search[<keywords>]"
FIXED_CLICKABLES = (pages.BACK_TO_SEARCH, pages.PREV, pages.NEXT, pages.BUY, *pages.SUB_PAGES)
SEARCH_REGEX = r"search\[[a-z0-9][a-z0-9 ,.$-]{0,59}\]"
# Characters escaped inside a regex character class: special there in Python's re or in the Rust regex-automata
# dialect outlines-core compiles (which reads "&&", "--", "~~" as set operations). Every one of them may be escaped
# in both; other characters (notably "<" and ">": "\<" is a word boundary in Rust) stay literal.
_CLASS_ESCAPE = frozenset("\\[]^-&~|")


def _char_class(chars) -> str:
    return "[" + "".join("\\" + c if c in _CLASS_ESCAPE else c for c in sorted(set(chars))) + "]"


def click_texts(catalogue) -> list[str]:
    """Every text ``click[...]`` can ever need in this catalogue (in ``pages.clickable_text`` form): the buttons and
    tabs, every product id and every option value of every product. Sorted, no duplicates."""
    texts = set(FIXED_CLICKABLES)
    for product in catalogue.products:
        texts.add(product["asin"].lower())
        for values in product["options"].values():
            texts.update(pages.clickable_text(v) for v in values)
    return sorted(t for t in texts if t)


def action_regex_for(texts) -> str:
    """The WebShop action syntax for constrained decoding, derived from ``texts`` (see :func:`click_texts`).

    ``click[...]`` takes a first character that some clickable starts with, then up to (longest - 1) characters that
    some clickable uses, so every clickable of the catalogue can be written (e.g. "< prev", "next >",
    "dark heather | white", "20x24in+20x48in", "a01#black") while the automaton stays one short chain of states.
    """
    texts = list(texts)
    longest = max(len(t) for t in texts)
    first = _char_class(t[0] for t in texts)
    rest = _char_class("".join(texts))
    return f"<answer>({SEARCH_REGEX}|click\\[{first}{rest}{{0,{longest - 1}}}\\])</answer>"


SYSTEM_PROMPT = """You are shopping on WebShop, a text web store with 1,000 products. Each episode gives you an \
instruction describing a product (attributes, options such as size or color, and a price limit). Find it and buy it \
with the right options; you have at most {max_turns} actions. The reward is the fraction of the instruction's \
attributes, options and price limit that the purchase meets (0 if the product type is wrong); success is a perfect 1.

Pages are shown as their visible texts separated by [SEP], followed by the admissible actions.
Actions:
  search[keywords]   search the catalogue (only on the search page), e.g. search[gluten free protein shake]
  click[text]        click a button, product id, option value or tab shown on the page: "back to search",
                     "< prev", "next >", a product id such as "b07fypsnh8", an option value such as "large",
                     "description", "features", "reviews", "buy now"
Select every option the instruction asks for on the product page before clicking "buy now".

Format: think inside <think>...</think>, then give exactly one action inside <answer>...</answer>, e.g.
<think>I should search for the product first.</think><answer>search[vegan protein shake]</answer>
A reply without <answer>...</answer> or with an action that is not available wastes a turn."""


class WebShopEnv(TextEnv):
    """WebShop on the 1,000-product catalogue.

    Args:
        split: goal split, "train" (6,410 synthetic goals) | "eval" (500) | "all" (6,910); for human goals
            "eval" or "all" (all 13).
        max_turns: actions per episode before truncation.
        data_dir: data root holding ``webshop/``, or a folder with the three WebShop files.
        goal_split: alias of ``split`` that wins when given (the registry's name for it).
        goals: "synthetic" (generated from the 415 products' instructions) | "human" (the 13 human instructions).
        price_seed: seed of the product-price and price-limit draws (see ``catalogue``).
        show_admissible: append the admissible actions to every observation.
    """

    # Constrained decoding for tiny models (SPEC: "their actions always parse"): the admissible set changes every
    # turn, so the grammar is the action *syntax* (``self.action_regex``, set per instance from the catalogue by
    # :func:`action_regex_for`); an admissible-but-wrong or inadmissible action is still possible and is handled as
    # an invalid action.

    def __init__(
        self,
        split: str = "train",
        max_turns: int = 30,
        data_dir: str | os.PathLike | None = None,
        goal_split: str | None = None,
        goals: str = "synthetic",
        price_seed: int = 0,
        show_admissible: bool = True,
    ):
        super().__init__(max_turns)
        self.catalogue = load_catalogue(data_dir, price_seed)
        self.split = goal_split or split
        self.goal_kind = goals
        self.goals = self.catalogue.goals(goals, self.split)
        self.show_admissible = show_admissible
        self.action_regex = action_regex_for(click_texts(self.catalogue))
        self.goal: Goal | None = None
        self._clear()

    def _clear(self) -> None:
        self._page = "search"
        self._keywords = ""
        self._hits: list[int] = []
        self._page_num = 1
        self._asin: str | None = None
        self._options: dict[str, str] = {}
        self._texts: list[str] = []
        self._clickables: dict[str, tuple] = {}

    # -- pages -------------------------------------------------------------------------------------
    def _show(self, kind: str, **kw: Any) -> None:
        instruction = self.goal.instruction
        self._page = kind
        if kind == "search":
            self._texts, self._clickables = pages.search_page(instruction)
        elif kind == "results":
            start = (self._page_num - 1) * pages.PER_PAGE
            shown = [self.catalogue.products[i] for i in self._hits[start : start + pages.PER_PAGE]]
            self._texts, self._clickables = pages.results_page(
                instruction, shown, self._page_num, len(self._hits)
            )
        elif kind == "item":
            self._texts, self._clickables = pages.item_page(instruction, self.catalogue.product(self._asin))
        elif kind == "sub":
            product = self.catalogue.product(self._asin)
            self._texts, self._clickables = pages.sub_page(instruction, product, kw["which"])
        else:
            self._texts, self._clickables = pages.done_page(kw["reward"])

    def admissible_actions(self) -> list[str]:
        actions = [SEARCH_PLACEHOLDER] if self._page == "search" else []
        return actions + [f"click[{c}]" for c in self._clickables]

    def _observation(self) -> str:
        text = pages.render(self._texts)
        if self.show_admissible and self._page != "done":
            text += "\nAdmissible actions: [" + ", ".join(self.admissible_actions()) + "]"
        return text

    def _info(self, **extra: Any) -> dict[str, Any]:
        goal = self.goal
        return dict(
            task_id=goal.key,
            goal=goal.instruction,
            query=goal.instruction,
            admissible_actions=self.admissible_actions(),
            **extra,
        )

    # -- TextEnv -----------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT.format(max_turns=self.max_turns)

    def goal_for_seed(self, seed: int) -> Goal:
        return self.goals[int(seed) % len(self.goals)]

    def _reset(self, seed: int | None) -> tuple[str, dict[str, Any]]:
        if seed is None:
            seed = int(self.np_random.integers(len(self.goals)))
        self.goal = self.goal_for_seed(seed)
        self._clear()
        self._show("search")
        return self._observation(), self._info(success=False)

    def _step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        match = _ACTION_RE.match(action.strip()) if action is not None else None
        verb, arg = (match.group(1).lower(), pages.clickable_text(match.group(2))) if match else (None, "")
        if verb == "search" and arg and self._page == "search":
            self._keywords = arg
            self._hits = self.catalogue.engine.search(arg)
            self._page_num = 1
            self._asin, self._options = None, {}
            self._show("results")
        elif verb == "click" and arg in self._clickables:
            target = self._clickables[arg]
            if target[0] == "buy":
                product = self.catalogue.product(self._asin)
                price = self.catalogue.prices[product["asin"]]
                reward, details = purchase_reward(product, self.goal, price, self._options)
                self._show("done", reward=reward)
                info = self._info(
                    success=reward >= 1.0 - 1e-9,
                    invalid_action=False,
                    purchased=product["asin"],
                    purchased_options=dict(self._options),
                    reward_details=details,
                )
                return self._observation(), float(reward), True, info
            self._click(target)
        else:
            note = self._invalid_note(action, verb, arg)
            return (
                f"{note}\n{self._observation()}",
                0.0,
                False,
                self._info(success=False, invalid_action=True),
            )
        return self._observation(), 0.0, False, self._info(success=False, invalid_action=False)

    def _invalid_note(self, action: str | None, verb: str | None, arg: str) -> str:
        """The line that tells the agent why its action did nothing (the quoted action is cut, see ``echo``)."""
        if action is None:
            return "Invalid reply: give one action inside <answer>...</answer>."
        head = f"Invalid action{echo(action)}:"
        if verb is None:
            return f"{head} use search[keywords] or click[text]."
        if verb == "search" and self._page != "search":
            return f"{head} there is no search bar on this page; click[back to search] first."
        if verb == "search":
            return f"{head} search needs keywords."
        return f"{head} not clickable on this page; click one of the admissible actions."

    def _click(self, target: tuple) -> None:
        kind = target[0]
        if kind == "back":
            self._show("search")
        elif kind == "next":
            self._page_num += 1
            self._show("results")
        elif kind == "prev" and self._page == "results":
            self._page_num -= 1
            self._show("results")
        elif kind == "prev" and self._page == "item":
            self._asin, self._options = None, {}  # WebShop re-renders the results, which resets the choice
            self._show("results")
        elif kind == "prev":  # from a sub-page back to its item page, options kept
            self._show("item")
        elif kind == "product":
            self._asin, self._options = target[1], {}
            self._show("item")
        elif kind == "option":
            self._options[target[1]] = target[2]
            self._show("item")
        elif kind == "sub":
            self._show("sub", which=target[1])
        else:
            raise AssertionError(f"unhandled clickable {target!r}")
