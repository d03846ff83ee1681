"""Config sections are their dataclasses' arguments (issue 29): one name per key from the command line to the code,
each section checked once where its dataclass is defined, the run config opened in one place."""

import ast
import dataclasses
import os

import pytest

from comprl_jax import config as config_lib
from comprl_jax.config.run import SECTIONS, RunConfig
from comprl_jax.experience import BankConfig, ManagerConfig, RetrievalConfig
from comprl_jax.rl.losses import ActorLossConfig
from comprl_jax.runtime.fields import FieldError, check, from_section

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "comprl_jax")


def test_every_section_of_every_scale_builds_its_dataclass_with_the_same_values():
    for variant in ("", "tiny", "cpu", "smollm", "tiny,baseline", "tiny,offline"):
        c = config_lib.build(variant, "t")
        rc = RunConfig.of(c)
        for name, cls in SECTIONS.items():
            section = getattr(rc, name)
            assert isinstance(section, cls)
            for key, value in config_lib.keys.flatten(c[name]).items():
                got = section
                for part in key.split("."):
                    got = getattr(got, part)
                assert (list(got) if isinstance(got, tuple) else got) == value, (variant, f"{name}.{key}")
    rc = RunConfig.of(config_lib.build("tiny", "t"))
    assert (
        rc.retrieval.window == 1.0 and rc.extractor.buffer.batch_size == 8 and rc.bank.max_entry_chars == 200
    )
    assert rc.actor.optim.lr == rc.actor.lr and RunConfig.of(rc) is rc


def test_a_bad_value_is_named_by_its_dotted_key():
    c = config_lib.build("tiny", "t")
    cases = [
        ("retrieval.candidates", 0, r"config key retrieval.candidates: must be >= retrieval.k=1, got 0"),
        ("extractor.buffer.cooldown", -1, r"config key extractor.buffer.cooldown: must be >= 0"),
        ("actor.sampling.top_p", 0.0, r"config key actor.sampling.top_p: must be in \(0, 1\], got 0.0"),
        ("mesh.placement", "far", r"config key mesh.placement: must be one of \('colocated', 'disjoint'\)"),
        ("rollout.group_size", 3, r"config key rollout.group_size: must be even"),
        ("env.backend", "gpu", r"config key env.backend: must be one of"),
        ("bank.dedup_threshold", 2.0, r"config key bank.dedup_threshold: must be in \[0, 1\]"),
        ("train.log_every", 0, r"config key train.log_every: must be >= 1"),
        ("checkpoint.max_to_keep", 1, r"config key checkpoint.max_to_keep: must be >= 2"),
    ]
    for key, value, msg in cases:
        bad = c.copy_and_resolve_references()
        with bad.unlocked():
            config_lib.set_key(bad, key, value)
        with pytest.raises(ValueError, match=msg):
            config_lib.validate(bad)
    bad = c.copy_and_resolve_references()
    with bad.unlocked():
        bad.retrieval.top_k = 2  # the old field name: one name per key now
    with pytest.raises(
        ValueError, match=r"config key retrieval.top_k: unknown; RetrievalConfig takes \[.*'k'"
    ):
        config_lib.validate(bad)


def test_a_key_missing_from_a_section_is_named_not_defaulted():
    """A config without a schema key (an older run's config.json that upgrade_saved does not know) would take the
    dataclass's default, which need not be the schema's (bank.partition: "task" vs "shared")."""
    tree = config_lib.build("tiny", "t").to_dict()
    del tree["bank"]["partition"], tree["actor"]["sampling"]["top_p"]
    with pytest.raises(
        ValueError, match=r"config key actor.sampling.top_p, bank.partition: missing from the config"
    ):
        RunConfig.of(tree)


def test_from_section_refuses_unknown_and_derived_keys_and_builds_nested_sections():
    assert (
        from_section(BankConfig, {"capacity": 3, "index": {"scann_min_size": 9}}, "bank").index.scann_min_size
        == 9
    )
    with pytest.raises(ValueError, match=r"config key bank.index.leaves: unknown"):
        from_section(BankConfig, {"index": {"leaves": 3}}, "bank")
    with pytest.raises(
        ValueError, match=r"actor.loss.sft_coef: unknown \(sft_coef comes from actor.self_distill"
    ):
        from_section(ActorLossConfig, {"sft_coef": 0.5}, "actor.loss")
    # extra: fields the code decides, beside the section's keys
    assert from_section(ActorLossConfig, {"clip_eps": 0.3}, "actor.loss", sft_coef=0.5).sft_coef == 0.5
    with pytest.raises(ValueError, match=r"config key manager.seed: unknown \(seed is set by the code\)"):
        from_section(ManagerConfig, {"seed": 3}, "manager", seed=1)
    r = RetrievalConfig(k=2)
    assert from_section(RetrievalConfig, r, "retrieval") is r  # an instance passes through

    @dataclasses.dataclass(frozen=True)
    class Two:
        a: int = 1

        def __post_init__(self):
            check(self.a > 0, "a", "must be positive", self.a)

    with pytest.raises(ValueError, match=r"^config key s.a: must be positive, got -1$"):
        from_section(Two, {"a": -1}, "s")
    with pytest.raises(FieldError, match=r"^a must be positive, got -1$"):
        Two(a=-1)  # built directly: the field, not a config key


def test_an_older_runs_flat_extractor_keys_upgrade_to_the_buffer_section():
    current = config_lib.build("tiny", "t").to_dict()
    old = {**current, "extractor": dict(current["extractor"]), "bank": dict(current["bank"])}
    buf = old["extractor"].pop("buffer")
    old["extractor"].update(buffer_size=buf["batch_size"], cooldown=3, alpha=buf["alpha"], recency_tau=0.0)
    old["extractor"]["max_entry_chars"] = old["bank"].pop("max_entry_chars")
    up = config_lib.upgrade_saved(old)
    rc = RunConfig.of(up)
    assert rc.extractor.buffer.cooldown == 3 and rc.extractor.buffer.recency_tau == 0.0
    assert rc.bank.max_entry_chars == 200 and up == {**current, "extractor": {**current["extractor"], "buffer": {
        **buf, "cooldown": 3, "recency_tau": 0.0}}}  # fmt: skip


def _py_files(root):
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(d, f)


# Modules handed the whole RunConfig: the trainer opens it (RunConfig.of) and run() drives the loop with it.
# Everything they build takes its sections.
WHOLE_CONFIG_READERS = ("loop/trainer.py", "loop/run.py")


def _whole_config_reads(path):
    """``(line, "c.section.field")`` for every read of a section's field through a name that holds the whole run
    config (``c``, ``cfg``, ``config``, ``self.config``, ``tr.config``)."""
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)):
            continue
        holder, section = node.value.value, node.value.attr
        if section not in SECTIONS:
            continue
        whole = (isinstance(holder, ast.Name) and holder.id in ("c", "cfg", "config")) or (
            isinstance(holder, ast.Attribute) and holder.attr == "config"
        )
        if whole:
            out.append((node.lineno, f"{ast.unparse(node)}"))
    return out


def test_the_run_config_is_opened_in_one_place_and_sections_are_read_where_they_are_built():
    """Only ``comprl_jax/config/`` knows ``ml_collections``; ``RunConfig.of`` is called by the trainer (and by
    ``config.validate``); outside the two modules that hold the whole config, no code reads ``<config>.<section>``:
    components get their section (ExtractorTrack takes extractor/bank/retrieval/manager, evaluation the env)."""
    ml, opened, deep = [], [], []
    for path in _py_files(PACKAGE):
        rel = os.path.relpath(path, PACKAGE)
        text = open(path).read()
        in_config = rel.startswith("config" + os.sep)
        if "ml_collections" in text and not in_config:
            ml.append(rel)
        if "RunConfig.of(" in text and not in_config:
            opened.append(rel)
        if rel not in WHOLE_CONFIG_READERS and not in_config:
            deep += [f"{rel}:{line}: {expr}" for line, expr in _whole_config_reads(path)]
    assert ml == [], f"only comprl_jax/config/ may use ml_collections: {ml}"
    assert opened == ["loop/trainer.py"], opened
    assert deep == [], "whole-config reads below the trainer:\n" + "\n".join(deep)
    # the finder finds what it looks for
    assert any(
        "cfg.actor.updates_per_batch" in e
        for _, e in _whole_config_reads(os.path.join(PACKAGE, "loop/trainer.py"))
    )


def test_a_run_from_before_the_moe_keys_upgrades_to_the_current_config():
    """Runs saved before {role}.moe_dispatch / moe_exchange_tokens existed resume with the model's own dispatch."""
    import copy

    current = config_lib.build("tiny", "t").to_dict()
    old = copy.deepcopy(current)
    for role in ("actor", "extractor"):
        del old[role]["moe_dispatch"], old[role]["moe_exchange_tokens"]
    assert config_lib.upgrade_saved(old) == current
