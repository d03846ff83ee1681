"""ALFWorld env: splits, traj_data rule, walkthrough replay, determinism, invalid actions, data-path errors.

Uses the offline copy in ../shared/data (unpacked once into the cache, ~10 s the first time). Resets cost ~1 s each,
so the number of games played is kept small.
"""

import json
import shutil

import numpy as np
import pytest

from comprl_jax.envs import alfworld_data, data_paths, registry
from comprl_jax.envs.alfworld import ALFWorldEnv, random_action


@pytest.fixture(scope="module")
def root():
    return alfworld_data.resolve_root()


def test_split_sizes(root):
    assert len(alfworld_data.list_games(root, "train")) == 3553
    assert len(alfworld_data.list_games(root, "valid_seen")) == 140
    assert len(alfworld_data.list_games(root, "valid_unseen")) == 134
    # the registry's sizes (evaluation plays each held-out game once) are the data's
    for split, n in registry.spec("comprl/ALFWorld-v0").eval_sizes.items():
        assert len(alfworld_data.list_games(root, split)) == n
    with pytest.raises(ValueError, match="'test'"):
        alfworld_data.list_games(root, "test")


def test_training_plays_the_released_codes_games(root, tmp_path, monkeypatch):
    """``rl_train``: the 1,466 games of ComplementaryRL's alfworld/data/rl_train.jsonl (SPEC §10: 1,466 train), one
    trial per task directory, all from ``train``; one of them (a BathtubBasin task) is in no split of the json_2.1.1
    game release, so 1,465 play here. None is held out (valid_unseen / valid_seen)."""
    from comprl_jax.envs import registry

    listed = alfworld_data.RL_TRAIN_LIST.read_text().split()
    assert len(listed) == len(set(listed)) == 1466 and alfworld_data.KNOWN_ABSENT <= set(listed)
    games = alfworld_data.list_games(root, "rl_train")
    assert len(games) == 1465 and set(games) <= set(alfworld_data.list_games(root, "train"))
    assert len({g.parts[-3] for g in games}) == 1465  # one trial per task directory
    types = {}
    for g in games:
        types[g.parts[-3].split("-")[0]] = types.get(g.parts[-3].split("-")[0], 0) + 1
    assert types == {
        "pick_two_obj_and_place": 354, "pick_and_place_simple": 322, "pick_clean_then_place_in_recep": 268,
        "pick_cool_then_place_in_recep": 212, "pick_heat_then_place_in_recep": 186, "look_at_obj_in_light": 123,
    }  # fmt: skip
    key = lambda g: "/".join(g.parts[-3:-1])  # noqa: E731
    held_out = {key(g) for s in ("valid_unseen", "valid_seen") for g in alfworld_data.list_games(root, s)}
    assert not held_out & {key(g) for g in games}
    assert registry.spec("comprl/ALFWorld-v0").train_split == "rl_train"
    # a listed game that is not there is an error naming it, not a smaller split
    bad = tmp_path / "list.txt"
    bad.write_text("\n".join([*listed[:3], "pick_and_place_simple-Nothing-None-Nowhere-1/trial_T0"]))
    monkeypatch.setitem(alfworld_data.DERIVED_SPLITS, "rl_train", ("train", bad))
    with pytest.raises(FileNotFoundError, match="1 of the 4 ALFWorld games .*Nowhere-1"):
        alfworld_data.list_games(root, "rl_train")


def test_traj_data_rule_matches_all_valid_records(root):
    records = json.loads(data_paths.data_file("alfworld", "valid_traj_data_min.json").read_text())
    assert len(records) == 474
    for key, record in records.items():
        _, task_dir, trial = key.split("/")
        derived = alfworld_data.traj_data_from_dirname(task_dir, trial)
        for field in ("task_id", "task_type", "pddl_params", "scene"):
            assert derived[field] == record[field], (key, field)
    # Hand-written: the lamp is the 4th field of look_at_obj_in_light, "None" means no movable receptacle.
    assert alfworld_data.traj_data_from_dirname("look_at_obj_in_light-Book-None-DeskLamp-308", "t")["pddl_params"] == {
        "object_target": "Book", "mrecep_target": "", "parent_target": "", "toggle_target": "DeskLamp",
        "object_sliced": False,
    }  # fmt: skip
    # Every unpacked game has the traj_data.json AlfredTWEnv requires.
    train_game = alfworld_data.list_games(root, "train")[0]
    traj = json.loads((train_game.parent / "traj_data.json").read_text())
    assert traj["task_type"] in alfworld_data.TASK_TYPES


@pytest.mark.slow
def test_walkthroughs_win_20_valid_unseen_games():
    env = ALFWorldEnv(split="valid_unseen", max_turns=40)
    wins, task_ids = 0, set()
    for seed in range(20):
        obs, info = env.reset(seed=seed)
        task_ids.add(info["task_id"])
        assert info["goal"] and info["goal"] in obs and info["query"].startswith(info["goal"])
        reward, terminated = 0.0, False
        for command in env.expert_plan():
            assert command in info["admissible_actions"], (info["task_id"], command)
            obs, reward, terminated, truncated, info = env.step(
                f"<think>plan</think><answer>{command}</answer>"
            )
            assert info["invalid_action"] is False
            if terminated:
                break
        wins += int(terminated and reward == 1.0 and info["success"])
    assert wins == 20
    assert len(task_ids) == 20  # seeds 0..19 are 20 different games


def test_same_seed_same_actions_same_observations():
    replies = [
        "<answer>look</answer>",
        "no answer",
        "<answer>go to nowhere 9</answer>",
        "<answer>inventory</answer>",
    ]

    def rollout():
        env = ALFWorldEnv(split="valid_unseen", max_turns=10)
        obs, info = env.reset(seed=7)
        seen, rng = [obs], np.random.default_rng(0)
        for reply in replies + [None] * 3:
            obs, _, term, trunc, info = env.step(reply or random_action(info, rng))
            seen.append(obs)
            if term or trunc:
                break
        return seen

    assert rollout() == rollout()


def test_invalid_actions_and_failure_reward():
    env = ALFWorldEnv(split="valid_unseen", max_turns=3)
    obs0, info = env.reset(seed=0)
    obs, reward, term, trunc, info = env.step("I will go to the desk")  # no <answer>: unparsable
    assert (reward, term, trunc, info["invalid_action"], info["action"]) == (0.0, False, False, True, None)
    obs, reward, term, trunc, info = env.step("<answer>fly to the moon</answer>")  # parsed, not admissible
    assert obs.startswith("Nothing happens.") and info["invalid_action"] and info["num_invalid"] == 2
    obs, reward, term, trunc, info = env.step("<answer>LOOK</answer>")  # case/space-normalised, valid
    assert (reward, term, trunc, info["invalid_action"], info["success"]) == (-1.0, False, True, False, False)
    assert info["num_invalid"] == 2 and info["turn"] == 3
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<answer>look</answer>")
    assert "<answer>" in env.system_prompt() and "go to (receptacle)" in env.system_prompt()


def test_user_alfworld_data_layout(root, tmp_path, monkeypatch):
    """A user's own download (json_2.1.1/<split>/..., traj_data.json beside each game, no index) works."""
    monkeypatch.setenv("COMPRL_CACHE", str(tmp_path / "cache"))
    src = alfworld_data.list_games(root, "valid_unseen")[:2]
    for game in src:
        rel = game.parent.relative_to(root)
        shutil.copytree(game.parent, tmp_path / "user" / rel)
    # A trial without traj_data.json is skipped, as AlfredTWEnv skips it.
    (tmp_path / "user" / src[0].parent.relative_to(root) / "traj_data.json").unlink()
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "user"))
    env = ALFWorldEnv(split="valid_unseen")
    assert env.root == tmp_path / "user" and [str(g) for g in env.games] == [
        str(tmp_path / "user" / src[1].relative_to(root))
    ]
    obs, info = env.reset(seed=5)
    assert info["task_id"] == "/".join(src[1].parts[-4:-1]) and "Your task is to:" in obs


def test_missing_data_names_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRL_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        data_paths.data_root()
    monkeypatch.setenv("COMPRL_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="json_2.1.1_game.tw-pddl.tar.xz"):
        data_paths.data_file("alfworld", alfworld_data.TARBALL)


def test_alfworld_package_loader_accepts_unpacked_games(root):
    """alfworld's own AlfredTWEnv.collect_game_files finds every valid_unseen game through our traj_data.json."""
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    config = {
        "env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6]},
        "dataset": {"eval_ood_data_path": str(root / "json_2.1.1" / "valid_unseen"), "num_eval_games": -1},
    }
    loader = AlfredTWEnv(config, train_eval="eval_out_of_distribution")
    assert sorted(loader.game_files) == [str(g) for g in alfworld_data.list_games(root, "valid_unseen")]
    assert ALFWorldEnv(split="eval").split == "valid_unseen"
