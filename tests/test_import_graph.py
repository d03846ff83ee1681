"""No module of the package imports another that imports it back (issue 15), lazy imports inside functions
included: a cycle broken by a function-level import is still a cycle in the design. Folders form layers and every
import goes down them (issue 29, ``LAYERS``)."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict[str, str]:
    mods = {}
    for root, _, files in os.walk(os.path.join(REPO, "comprl_jax")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    return mods


def _import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (a submodule importing its own parent package is not an edge:
    Python runs the parent's ``__init__`` first either way)."""
    mods = _modules()

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                    for a in node.names
                ]
            else:
                continue
            for t in targets:
                r = resolve(t) if t.startswith("comprl_jax") else ""
                if r and r != m and not m.startswith(r + "."):
                    graph[m].add(r)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_in_the_package():
    graph = _import_graph()
    assert (
        "comprl_jax.loop.trainer" in graph
        and "comprl_jax.rollout.engines" in graph["comprl_jax.loop.trainer"]
    )
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


# The layers of the package, lowest first (issue 29). A module may import its own folder and the folders of lower
# layers, never a folder of its own layer or above. ``config`` (schema, methods, scales, and RunConfig, which builds
# each section's dataclass from the layers below) sits under ``loop``, which opens the run config.
LAYERS = (
    ("runtime",),  # processes, meshes, sharding rules, checkpoints, metrics
    ("tokenizer", "envs"),
    ("models",),
    ("sampling", "rl"),
    ("experience",),
    ("rollout",),  # episode records and the two engines
    ("roles",),  # a trained model and its sampler, training batches
    ("config",),
    ("loop",),  # the trainer and what it drives
    ("warm",),  # the warm-start corpus, vocabulary and supervised trainer (issue 49)
)


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    rank = {f: i for i, layer in enumerate(LAYERS) for f in layer}
    out = []
    for a, targets in sorted(graph.items()):
        fa = _folder(a)
        if fa == "comprl_jax":  # the package's own __init__
            continue
        assert fa in rank, f"{a}: folder {fa!r} is in no layer of LAYERS (add it where it belongs)"
        for b in sorted(targets):
            fb = _folder(b)
            if fb != fa and rank[fb] >= rank[fa]:
                out.append(f"{a} -> {b} ({fa} may not import {fb})")
    return out


def test_the_layer_rule_flags_an_upward_and_a_sideways_import():
    graph = {
        "comprl_jax.runtime.sharding": {"comprl_jax.sampling"},  # upward
        "comprl_jax.rl.update": {"comprl_jax.sampling.decode"},  # same layer, other folder
        "comprl_jax.loop.trainer": {"comprl_jax.loop.evaluation", "comprl_jax.runtime.metrics"},  # allowed
    }
    assert _layer_violations(graph) == [
        "comprl_jax.rl.update -> comprl_jax.sampling.decode (rl may not import sampling)",
        "comprl_jax.runtime.sharding -> comprl_jax.sampling (runtime may not import sampling)",
    ]


def test_every_import_in_the_package_goes_down_the_layers():
    graph = _import_graph()
    assert not _layer_violations(graph), "\n".join(_layer_violations(graph))


def _strings_in_order(node) -> list[str]:
    """The string constants under ``node``, left to right (``ast.walk`` is breadth-first: a pathlib ``/`` chain
    would come out last part first)."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    return [s for child in ast.iter_child_nodes(node) for s in _strings_in_order(child)]


def _launch_scripts_the_tests_load() -> list[str]:
    """Every launch script a test file loads with ``spec_from_file_location``, however it spells the path
    ("launch/demo.py", os.path.join(REPO, "launch", "bench", "moe.py"), a pathlib ``/`` chain, a name assigned
    one of those): the string parts of the path argument, joined."""
    found = set()
    for f in sorted(os.listdir(os.path.join(REPO, "tests"))):
        if not f.endswith(".py") or f == os.path.basename(__file__):
            continue
        tree = ast.parse(open(os.path.join(REPO, "tests", f)).read())
        assigned = {
            t.id: n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "spec_from_file_location"):
                continue
            arg = n.args[1]
            arg = assigned.get(arg.id, arg) if isinstance(arg, ast.Name) else arg
            parts = _strings_in_order(arg)
            rel = os.path.normpath("/".join(parts))
            if rel.startswith("launch" + os.sep) and os.path.exists(os.path.join(REPO, rel)):
                found.add(rel)
    return sorted(found)


def test_launch_scripts_the_tests_import_share_one_process_without_flag_clashes():
    """absl allows one definition of a flag name per process, and pytest-xdist puts tests that import launch
    scripts in one worker in any order (a DuplicateFlagError failed nine tests of one CI run, and eleven of
    another when launch/bench/compare_warm.py defined --steps and --study at import). Every script a test loads
    is loaded here into one process: a script's flags belong in a ``define_flags()`` run only as a script, or
    must not clash."""
    import subprocess
    import sys

    scripts = _launch_scripts_the_tests_load()
    for must in (
        "launch/bench/compare_warm.py",
        "launch/demo.py",
        "launch/compile_check.py",
        "launch/bench/train.py",
    ):
        assert must in scripts, (must, scripts)  # the finder itself works
    code = (
        "import importlib.util, sys\n"
        f"for i, path in enumerate({scripts!r}):\n"
        "    name = f'launch_script_{i}'\n"
        "    spec = importlib.util.spec_from_file_location(name, path)\n"
        "    mod = importlib.util.module_from_spec(spec)\n"
        "    sys.modules[name] = mod\n"
        "    spec.loader.exec_module(mod)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
