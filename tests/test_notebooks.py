"""The notebooks in ``notebooks/`` run top to bottom without an error, each in its own
Jupyter kernel (so sync calls run inside the kernel's running event loop), and are
stored in git without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


#: What each notebook's output must show: the memory reached an answer (or a tool call).
REMEMBERED = {"quickstart": "Biscuit", "langchain": "Biscuit", "llama_index": "Biscuit",
              "langchain_agent": "'args': {'city': 'Lisbon'}", "inspect": "Pixel"}


@pytest.mark.parametrize("name", sorted(REMEMBERED))
def test_notebook_runs_without_errors(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    cells = _code_cells(nb)
    assert all(not c.outputs and c.execution_count is None for c in cells), "outputs must be stripped in git"
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in cells for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert REMEMBERED[name] in text
    if name == "quickstart":
        assert any("image/png" in o.get("data", {}) for o in outputs)  # the TTFT-vs-k plot
    if name == "inspect":  # the rich reprs (issue 41): Memory, a search, two Generations
        shown = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
        assert len(shown) == 4, shown
        assert "KV pool" in shown[0] and "user_id=ada" in shown[0]
        assert "hybrid ranking" in shown[1] and "Pixel" in shown[1]
        assert "memory as KV" in shown[2] and ">text<" not in shown[2]  # every memory injected
        assert ">text<" in shown[3] and "not encoded yet" in shown[3]  # the new memory as text, and why
        assert all("text/plain" in o["data"] for o in outputs if "text/html" in o.get("data", {}))
