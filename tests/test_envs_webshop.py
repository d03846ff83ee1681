"""WebShop env: catalogue/goals/splits, price rule, reward formula, search quality, purchases through the env,
the constrained-decoding action regex."""

import re

import numpy as np
import pytest

from comprl_jax.envs import registry
from comprl_jax.envs.webshop import pages, reward
from comprl_jax.envs.webshop.catalogue import Goal, load_catalogue, price_bound
from comprl_jax.envs.webshop.env import WebShopEnv
from comprl_jax.envs.webshop.search import tokenize


@pytest.fixture(scope="module")
def env():
    return WebShopEnv(split="eval", max_turns=30)


def answer(action):
    return f"<think>...</think><answer>{action}</answer>"


def test_catalogue_goals_and_splits():
    cat = load_catalogue()
    assert len(cat.products) == 1000
    assert len(cat.synthetic) == 6910 and len({g.asin for g in cat.synthetic}) == 415
    assert len(cat.human) == 13
    train, evaluation = cat.goals("synthetic", "train"), cat.goals("synthetic", "eval")
    assert (len(train), len(evaluation)) == (6410, 500)
    assert registry.spec("comprl/WebShop-v0").eval_sizes == {"eval": len(evaluation)}
    assert {g.key for g in train} | {g.key for g in evaluation} == {g.key for g in cat.synthetic}
    assert not {g.key for g in train} & {g.key for g in evaluation}
    assert load_catalogue() is cat  # cached per process
    with pytest.raises(ValueError, match="'test'"):
        cat.goals("synthetic", "test")
    with pytest.raises(ValueError, match="evaluation set"):
        cat.goals("human", "train")
    # Every synthetic goal's options are one value per option name of its product, names sorted.
    goal = cat.synthetic[1]
    product = cat.product(goal.asin)
    assert len(goal.options) == len(product["options"])
    assert all(
        v in product["options"][n] for n, v in zip(sorted(product["options"]), goal.options, strict=True)
    )


def test_price_rule():
    rng = np.random.default_rng(0)
    # price 34.5: candidates 40, 50, 60, 70; the max of two distinct draws is never 40.
    uppers = {price_bound(34.5, rng)[0] for _ in range(200)}
    assert uppers == {50.0, 60.0, 70.0}
    assert price_bound(975.0, rng) == (990.0, ", and price lower than 990.00 dollars")  # only 980, 990 above
    assert price_bound(985.0, rng) == (1_000_000.0, "")  # one candidate: no price limit
    cat = load_catalogue()
    for goal in cat.synthetic[:200]:
        price = cat.prices[goal.asin]
        assert goal.price_upper > price
        if goal.price_upper < 1_000_000:
            assert goal.instruction.endswith(f", and price lower than {goal.price_upper:.2f} dollars")
    # Range prices are drawn inside the range.
    ranged = [p for p in cat.products if len(p["pricing"]) == 2]
    assert ranged and all(min(p["pricing"]) <= cat.prices[p["asin"]] <= max(p["pricing"]) for p in ranged)


def _goal(**kw):
    base = dict(
        key="t/0", asin="X", instruction="", attributes=("gluten free", "soy free"), options=("black forest",),
        price_upper=20.0, query="shakes", product_category="Food › Drinks › Shakes", name="Vegan Protein Shake",
    )  # fmt: skip
    base.update(kw)
    return Goal(**base)


def _product(**kw):
    base = dict(
        asin="X", Title="Vegan Protein Shake, Chocolate", BulletPoints=["Soy-free recipe"], Description="A shake.",
        Attributes=["gluten free"], query="shakes", product_category="Food › Drinks › Shakes",
    )  # fmt: skip
    base.update(kw)
    return base


def test_reward_formula_hand_computed():
    # Attributes: "gluten free" fuzzy-matches; "soy free" is not an attribute and "soy free" is not a substring
    # of "soy-free recipe" -> 1 of 2. Option "black" vs goal "black forest" -> both normalise to "black" -> 1 of 1.
    # Price 15 <= 20 -> 1. (1 + 1 + 1) / (2 + 1 + 1) = 0.75, r_type 1 (same query).
    r, details = reward.purchase_reward(_product(), _goal(), 15.0, {"color": "black"})
    assert (details["attribute_matches"], details["option_matches"], details["price_ok"]) == (1, 1, True)
    assert r == pytest.approx(0.75)
    # Too expensive and no option clicked: (1 + 0 + 0) / 4 = 0.25.
    assert reward.purchase_reward(_product(), _goal(), 25.0, {})[0] == pytest.approx(0.25)
    # Different query and category, title nouns {vegan, protein, shake} vs {protein, bar}: overlap 1/3 > 0.2 -> 1.0.
    other = _product(query="bars", product_category="Snacks › Bars", Title="Protein Bar")
    assert reward.type_reward(other, _goal())["r_type"] == 1.0
    # Overlap 0 -> r_type 0, the whole reward is 0.
    unrelated = _product(query="bars", product_category="Snacks › Bars", Title="Garden Hose")
    assert reward.purchase_reward(unrelated, _goal(), 15.0, {"color": "black"})[0] == 0.0
    # Overlap exactly 0.2 (1 of 5 nouns) with no query/category match -> 0.5.
    five = _goal(name="Vegan Protein Shake Powder Tub")
    assert reward.type_reward(_product(query="q", product_category="A", Title="Tub"), five)["r_type"] == 0.5
    # Options match by fuzzy token-set ratio > 85 alone, as the original get_option_reward: "x-large" contains every
    # token of "large" (ratio 100, a match, as in the original); "medium" shares no token, so the ratio is the plain
    # indel ratio 2 x |LCS "e"| / (6 + 5) = 18.
    sized = _goal(options=("large",))
    assert reward.fuzzy("x-large", "large") == 100 and reward.fuzzy("medium", "large") == 18
    assert reward.option_matches(sized, {"size": "x-large"}) == 1
    assert reward.option_matches(sized, {"size": "medium"}) == 0
    # Counted per goal option: two clicked values matching one goal option count once.
    assert reward.option_matches(sized, {"size": "large", "fit": "large"}) == 1


def test_wrong_colour_named_in_the_product_text_earns_nothing():
    # The case: the goal asks for red, 128mb; the agent buys black, 128mb, and "black" is in the title and
    # the description. No substring rule for options: red vs [black, 128mb] -> 0; 128mb -> 1 of 2 options.
    # Attributes 2 of 2 (gluten free by Attributes, "soy free" in the title), price ok:
    # (2 + 1 + 1) / (2 + 2 + 1) = 0.8.
    goal = _goal(options=("red", "128mb"))
    product = _product(Title="Vegan Protein Shake, Soy Free, Black", Description="A black shake in 128mb.")
    r, details = reward.purchase_reward(product, goal, 15.0, {"color": "black", "size": "128mb"})
    assert details["option_matches"] == 1 and r == pytest.approx(0.8)
    assert reward.purchase_reward(product, goal, 15.0, {"color": "red", "size": "128mb"})[0] == 1.0


def test_a_wrong_colour_never_scores_one():
    """Every synthetic goal with a colour option, bought as the goal product with the goal's other options and each
    other colour of that product: never reward 1.0. A colour counts as other when no clicked value matches the
    goal's colour by the original's own rule (colour normalisation, then token-set ratio > 85): "black forest" is
    "black" to WebShop."""
    cat = load_catalogue()
    checked = 0
    for goal in cat.synthetic:
        product = cat.product(goal.asin)
        names = sorted(product["options"])
        if "color" not in names:
            continue
        want = reward.normalize_color(goal.options[names.index("color")])
        for other in product["options"]["color"]:
            chosen = dict(zip(names, goal.options, strict=True)) | {"color": other}
            if any(reward.fuzzy(reward.normalize_color(v), want) > 85 for v in chosen.values()):
                continue  # the same colour to WebShop, or another option already names it
            assert reward.option_matches(goal, chosen) < len(goal.options), (goal.key, goal.options, other)
            if checked % 10 == 0:  # the whole reward on a tenth of them (it costs ~1 ms a purchase)
                r, _ = reward.purchase_reward(product, goal, cat.prices[goal.asin], chosen)
                assert r < 1.0, (goal.key, goal.options, other)
            checked += 1
    assert checked > 5000, checked  # measured 9,606 wrong-colour purchases


def test_reward_helpers():
    assert reward.normalize_color("black forest") == "black"
    assert reward.normalize_color("123alabaster") == "alabaster"
    assert reward.normalize_color("webshop") == "webshop"
    assert reward.fuzzy("Gluten-Free", "gluten free") == 100  # processed: case and punctuation ignored
    assert reward.title_nouns("The Vegan Protein Shake, 12 Pack") == ["vegan", "protein", "shake"]
    assert tokenize("Red Shoes for the Boxes & Dresses") == ["red", "shoe", "box", "dress"]


def _buy(env, seed, asin=None, options=None):
    """Plays one episode through the env: search the goal text, page to the product, click options, buy."""
    obs, info = env.reset(seed=seed)
    goal = env.goal
    asin = (asin or goal.asin).lower()
    obs, *_ = env.step(answer(f"search[{goal.instruction}]"))
    while f"click[{asin}]" not in env.admissible_actions() and "click[next >]" in env.admissible_actions():
        env.step(answer("click[next >]"))
    if f"click[{asin}]" not in env.admissible_actions():  # not in the top 50: search the product's title
        env.step(answer("click[back to search]"))
        env.step(answer(f"search[{env.catalogue.product(asin)['Title']}]"))
    obs, r, term, trunc, info = env.step(answer(f"click[{asin}]"))
    assert not info["invalid_action"], obs
    for value in goal.options if options is None else options:
        obs, r, term, trunc, info = env.step(answer(f"click[{value}]"))
        assert not info["invalid_action"], value
    obs, r, term, trunc, info = env.step(answer("click[buy now]"))
    assert term and not trunc and info["purchased"] == asin.upper()
    return r, info


def test_buying_the_goal_scores_one_on_50_goals(env):
    rewards = [_buy(env, seed)[0] for seed in range(50)]
    assert rewards == [1.0] * 50


def test_wrong_product_scores_below_one(env):
    cat = env.catalogue
    for seed in range(10):
        goal = env.goal_for_seed(seed)
        hits = [cat.products[i]["asin"] for i in cat.engine.search(goal.instruction)]
        wrong = next(a for a in hits if a != goal.asin)
        r, info = _buy(env, seed, asin=wrong, options=[])
        assert r < 1.0 and not info["success"]


def test_search_finds_goal_product_in_top10(env):
    cat = env.catalogue
    goals = cat.goals("synthetic", "eval")
    found = sum(cat.asin_to_index[g.asin] in cat.engine.search(g.instruction)[:10] for g in goals)
    rate = found / len(goals)
    print(f"webshop top-10 search hit rate on {len(goals)} eval goals: {rate:.3f}")
    assert rate >= 0.8  # measured 0.918 (459 / 500)


def _clickable_texts(catalogue):
    """Independently of the env's code: the lowercase, single-spaced text of every option value of every product,
    every product id, and the buttons / tabs."""
    texts = {"back to search", "< prev", "next >", "buy now", "description", "features", "reviews"}
    for product in catalogue.products:
        texts.add(product["asin"].lower())
        for values in product["options"].values():
            texts.update(" ".join(v.lower().split()) for v in values)
    return sorted(texts)


def test_action_regex_accepts_every_option_value_and_both_pagination_buttons(env):
    from comprl_jax.sampling.automaton import accepts, from_regex

    texts = _clickable_texts(env.catalogue)
    assert {"< prev", "next >", "dark heather | white", "20x24in+20x48in", "a01#black"} <= set(texts)
    pattern = re.compile(env.action_regex)
    rejected = [t for t in texts if not pattern.fullmatch(f"<answer>click[{t}]</answer>")]
    assert not rejected, (len(rejected), rejected[:10])
    assert pattern.fullmatch("<answer>search[gluten free protein shake]</answer>")
    for bad in ["<answer>click[]</answer>", "<answer>buy[x]</answer>", "<answer>click[ x]</answer>"]:
        assert not pattern.fullmatch(bad), bad
    # The same regex through outlines-core, as constrained decoding builds it: a byte-level vocabulary (one token per
    # byte, so multi-byte characters such as "×" are two tokens) and an EOS id.
    vocab = [bytes([b]) for b in range(256)] + [b""]
    automaton = from_regex(env.action_regex, vocab, stop_ids=[256])
    # 195 states (a chain per verb, plus a middle state per position for the 2-byte "×"); the fixed regex this
    # replaced, which could not write 304 of these texts, had 172.
    assert automaton.num_states <= 200, automaton.num_states
    not_accepted = [t for t in texts if not accepts(automaton, list(f"<answer>click[{t}]</answer>".encode()))]
    assert not not_accepted, not_accepted[:10]


def test_every_option_value_is_clickable_as_shown(env):
    # On its item page, every option value is a clickable under its lowercase, single-spaced text.
    for product in env.catalogue.products:
        _, clickables = pages.item_page("goal", product)
        for values in product["options"].values():
            for value in values:
                assert clickables[" ".join(value.lower().split())][0] == "option", (product["asin"], value)
    # Through the env: eval goal 314 wants "a3-wine\xa0red" (a no-break space) and 2 wants "red | blue"; clicking them
    # as shown, with a plain space or in capitals, selects them and the purchase scores 1.
    assert env.goal_for_seed(314).options[0] == "a3-wine\xa0red"
    assert _buy(env, 314)[0] == 1.0
    assert _buy(env, 314, options=["A3-WINE  RED", "x-large"])[0] == 1.0
    assert env.goal_for_seed(2).options[0] == "red | blue" and _buy(env, 2)[0] == 1.0


def test_pages_and_invalid_actions():
    env = WebShopEnv(split="eval", max_turns=7)
    obs, info = env.reset(seed=3)
    goal = env.goal
    assert obs.startswith("WebShop [SEP] Instruction: [SEP] " + goal.instruction + " [SEP] Search")
    assert info["admissible_actions"] == ["search[<keywords>]"] and info["query"] == goal.instruction
    # An invalid action leaves the page as it was, and the observation starts with a line saying why.
    for bad, why in [
        ("search for it", "Invalid reply: give one action inside <answer>...</answer>."),
        (answer("click[buy now]"), "Invalid action 'click[buy now]': not clickable on this page"),
        (answer("buy[this]"), "Invalid action 'buy[this]': use search[keywords] or click[text]."),
        (answer("search[]"), "Invalid action 'search[]': search needs keywords."),
    ]:
        obs2, r, term, trunc, info = env.step(bad)
        assert (r, term, info["invalid_action"]) == (0.0, False, True)
        assert obs2.startswith(why) and obs2.endswith("\n" + obs), obs2
    assert info["num_invalid"] == 4
    obs, r, term, trunc, info = env.step(answer("SEARCH[" + goal.instruction + "]"))  # verb case-insensitive
    assert not info["invalid_action"] and "Page 1 (Total results: " in obs and goal.instruction in obs
    obs2, r, term, trunc, info = env.step(answer("search[another]"))  # no search bar on the results page
    assert info["invalid_action"] and obs2.endswith("\n" + obs)
    assert obs2.startswith("Invalid action 'search[another]': there is no search bar on this page")
    obs, r, term, trunc, info = env.step(answer("click[back to search]"))
    assert (r, term, trunc) == (0.0, False, True) and obs.startswith("WebShop [SEP]")  # 7 turns, no purchase
    assert "search[keywords]" in env.system_prompt() and "click[text]" in env.system_prompt()


def test_sub_pages_and_prev():
    env = WebShopEnv(split="eval", max_turns=30)
    env.reset(seed=0)
    goal = env.goal
    env.step(answer(f"search[{env.catalogue.product(goal.asin)['Title']}]"))
    item, *_ = env.step(answer(f"click[{goal.asin}]"))
    assert item.split(" [SEP] ")[-1].startswith("Buy Now")
    features, *_ = env.step(answer("click[features]"))
    bullets = [b.strip() for b in env.catalogue.product(goal.asin)["BulletPoints"] if b.strip()]
    assert features.split("\n")[0].endswith(pages.SEP.join(bullets))
    back, *_ = env.step(answer("click[< prev]"))
    assert back == item
    results, *_ = env.step(answer("click[< prev]"))
    assert "Page 1 (Total results:" in results


def test_same_seed_same_actions_same_observations():
    def rollout():
        env = WebShopEnv(split="train", max_turns=10)
        obs, info = env.reset(seed=11)
        seen, rng = [obs], np.random.default_rng(1)
        actions = [answer(f"search[{env.goal.instruction}]")]
        for _ in range(9):
            obs, r, term, trunc, info = env.step(actions.pop() if actions else answer(
                info["admissible_actions"][int(rng.integers(len(info["admissible_actions"])))]
                .replace("<keywords>", "red shoes")
            ))  # fmt: skip
            seen.append(obs)
            if term or trunc:
                break
        return seen

    assert rollout() == rollout()


def test_human_goals_and_missing_data(tmp_path):
    env = WebShopEnv(goals="human", goal_split="all", max_turns=5)
    assert len(env.goals) == 13
    obs, info = env.reset(seed=0)
    assert info["task_id"] == "human/0" and info["goal"] in obs
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        WebShopEnv(data_dir=tmp_path)
