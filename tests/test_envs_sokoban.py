"""Sokoban on gym-sokoban's reverse-play rooms: determinism, isolated RNG, push rules, a BFS solver via text."""

import collections
import random

import numpy as np

from comprl_jax.envs import make
from comprl_jax.envs.sokoban_env import MOVES, generate, render_grid

SOKO = "comprl/Sokoban-6x6-2-v0"


def parse(obs: str):
    """(walls, targets, boxes, player) from the text observation only."""
    lines = obs.split("\n")
    grid = lines[lines.index("Map:") + 1 : lines.index("Legend:")]
    walls, targets, boxes, player = set(), set(), set(), None
    for r, row in enumerate(grid):
        for c, ch in enumerate(row):
            p = (r, c)
            if ch == "#":
                walls.add(p)
            if ch in "O*+":
                targets.add(p)
            if ch in "X*":
                boxes.add(p)
            if ch in "P+":
                player = p
    return walls, targets, frozenset(boxes), player


def solve(obs: str, limit: int = 200_000):
    """Breadth-first search over (player, boxes) states: a shortest move sequence, or None."""
    walls, targets, boxes, player = parse(obs)
    start = (player, boxes)
    prev = {start: None}
    dq = collections.deque([start])
    while dq and len(prev) < limit:
        state = dq.popleft()
        pl, bx = state
        if bx <= targets:
            path = []
            while prev[state] is not None:
                state, move = prev[state]
                path.append(move)
            return path[::-1]
        for name, (dr, dc) in MOVES.items():
            nxt = (pl[0] + dr, pl[1] + dc)
            if nxt in walls:
                continue
            nb = bx
            if nxt in bx:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond in walls or beyond in bx:
                    continue
                nb = (bx - {nxt}) | {beyond}
            new = (nxt, nb)
            if new not in prev:
                prev[new] = (state, name)
                dq.append(new)
    return None


def test_same_seed_same_actions_identical_and_rng_isolated():
    a, b = make(SOKO), make(SOKO)
    rng = random.Random(0)
    actions = [rng.choice(list(MOVES)) for _ in range(20)]
    random.seed(11)
    np.random.seed(11)
    before = (random.random(), np.random.rand())
    random.seed(11)
    np.random.seed(11)
    seqs = []
    for env in (a, b, a):
        obs, info = env.reset(seed=42)
        assert info["query"] == obs and info["task_id"] == "Sokoban-6x6-2"
        seq = [obs] + [env.step(f"<answer>{m}</answer>")[0] for m in actions]
        seqs.append(seq)
    assert seqs[0] == seqs[1] == seqs[2]
    assert (random.random(), np.random.rand()) == before, "room generation must not disturb the global RNGs"
    assert len({a.reset(seed=s)[0] for s in range(8)}) == 8


def test_push_rules_hand_built_room():
    env = make(SOKO, max_turns=10)
    env.reset(seed=0)
    walls = np.ones((6, 6), bool)
    walls[1:5, 1:5] = False
    walls[1, 4] = True
    env.walls, env.targets, env.boxes, env.player = walls, {(1, 3), (4, 4)}, {(2, 3), (3, 3)}, (4, 3)
    assert render_grid(env.walls, env.targets, env.boxes, env.player) == "\n".join(
        ["######", "#__O##", "#__X_#", "#__X_#", "#__PO#", "######"]
    )
    obs, r, term, _, info = env.step("<answer>up</answer>")  # two boxes in a row: nothing moves
    assert "does not move" in obs and env.player == (4, 3) and not info["invalid_action"]
    env.boxes = {(3, 3)}  # one box: it is pushed one square
    env.targets = {(2, 3)}
    obs, r, term, _, info = env.step("<answer>north</answer>")
    assert env.player == (3, 3) and env.boxes == {(2, 3)} and term and r == 1.0 and info["success"]
    assert "Boxes on targets: 1/1" in obs


def test_invalid_action_counted_not_raised():
    env = make(SOKO)
    obs0, _ = env.reset(seed=3)
    obs, r, term, trunc, info = env.step("<answer>jump</answer>")
    assert info["invalid_action"] and info["num_invalid"] == 1 and not term and r == 0.0
    assert obs.split("Map:")[1] == obs0.split("Map:")[1]


def test_generated_rooms_are_real_and_solvable_by_text_bfs():
    walls, targets, boxes, player = generate(5)
    assert walls.shape == (6, 6) and len(targets) == len(boxes) == 2 and not boxes <= targets
    env = make(SOKO, max_turns=200)
    solved, lengths = 0, []
    for seed in range(100):
        obs, _ = env.reset(seed=seed)
        plan = solve(obs)
        if plan is None:
            continue
        lengths.append(len(plan))
        for move in plan:
            obs, _, term, trunc, info = env.step(f"<think>plan</think><answer>{move}</answer>")
        solved += bool(term and info["success"])
    print(
        f"Sokoban 6x6/2 text-BFS solved {solved}/100; solution length median {np.median(lengths)}, max {max(lengths)}"
    )
    assert solved >= 95
