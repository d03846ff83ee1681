"""Procedural bugs for SWE-Lite (comprl_jax/envs/swe/bugs.py): every edit of a hand-written function, exactly."""

import ast

from comprl_jax.envs.swe import bugs

SRC = '''def f(xs, n=3, flag=True):
    """doc"""
    total = 0
    for i in range(1, len(xs)):
        if xs[i] < n and flag:
            total += xs[i - 1] * 2
    if not xs:
        return None
    print("done", total)
    return total >= 10


class C:
    def g(self, k):
        if k in self.d:
            return self.d[k]  # élan: a non-ASCII comment before nothing
        return k is None; x = 1
'''


def test_every_edit_of_a_hand_written_function_in_source_order():
    got = [
        (m.kind, m.function, m.line, m.before.strip(), m.replacement.strip()) for m in bugs.candidates(SRC)
    ]
    assert got == [
        ("wrong_constant", "f", 1, "True", "False"),
        ("remove_statement", "f", 3, "total = 0", ""),
        ("wrong_constant", "f", 3, "0", "1"),
        ("off_by_one", "f", 4, "1", "0"),
        ("off_by_one", "f", 4, "1", "2"),
        ("swap_args", "f", 4, "1, len(xs)", "len(xs), 1"),
        ("op_swap", "f", 5, "<", "<="),
        ("op_swap", "f", 5, "and", "or"),
        ("op_swap", "f", 6, "-", "+"),
        ("off_by_one", "f", 6, "1", "0"),
        ("off_by_one", "f", 6, "1", "2"),
        ("op_swap", "f", 6, "*", "//"),
        ("off_by_one", "f", 6, "2", "1"),
        ("off_by_one", "f", 6, "2", "3"),
        ("remove_branch", "f", 7, "if not xs:\n        return None", ""),
        ("wrong_constant", "f", 8, "None", "0"),
        ("remove_statement", "f", 9, 'print("done", total)', ""),
        ("swap_args", "f", 9, '"done", total', 'total, "done"'),
        ("op_swap", "f", 10, ">=", ">"),
        ("off_by_one", "f", 10, "10", "11"),
        ("off_by_one", "f", 10, "10", "9"),
        (
            "remove_branch",
            "C.g",
            15,
            "if k in self.d:\n            return self.d[k]  # élan: a non-ASCII comment before nothing",
            "",
        ),
        ("op_swap", "C.g", 15, "in", "not in"),
        ("op_swap", "C.g", 17, "is", "is not"),
        ("wrong_constant", "C.g", 17, "1", "None"),
        # `return k is None; x = 1` shares its line: not removable; the early return inside the `if` is its
        # block's only statement: not removable either
    ]


def test_each_edit_parses_changes_one_place_and_diffs_back():
    for m in bugs.candidates(SRC):
        out = bugs.apply(SRC, m)
        ast.parse(out)  # every edit leaves valid Python
        assert out != SRC and out[: m.start] == SRC[: m.start]
        diff = bugs.unified_diff("pkg/mod.py", SRC, out)
        assert diff.startswith("--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ ")
        removed = [ln[1:] for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
        assert 1 <= len(removed) <= 2  # one line, or an if with its one-line body


def test_source_that_does_not_parse_gives_no_candidates():
    assert bugs.candidates("def f(:\n") == []
    assert set(bugs.KINDS) >= {m.kind for m in bugs.candidates(SRC)}
