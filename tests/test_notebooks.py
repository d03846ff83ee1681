"""Executes the jupytext notebooks (the ``.py`` percent files are the source of truth) and checks the pairing."""

import pathlib

import jupytext
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", ["loss_components"])
def test_notebook_executes(name):
    nb = jupytext.read(NOTEBOOKS / f"{name}.py")
    # The kernel inherits this process's environment (8 fake CPU devices, offline flags) and runs in notebooks/.
    NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors


@pytest.mark.parametrize("name", ["loss_components"])
def test_notebook_pairing_in_sync(name):
    py = jupytext.read(NOTEBOOKS / f"{name}.py")
    ipynb_path = NOTEBOOKS / f"{name}.ipynb"
    if not ipynb_path.exists():
        pytest.skip("no paired .ipynb")
    ipynb = jupytext.read(ipynb_path)
    assert [c.source for c in py.cells] == [c.source for c in ipynb.cells], (
        f"{ipynb_path.name} is out of sync: run `jupytext --sync notebooks/{name}.py`"
    )
