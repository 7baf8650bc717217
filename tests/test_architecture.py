"""The shape of the package: the vLLM fence, layers without cycles, and a module map that
matches the code (docs/architecture.md).

Layers, bottom up:
- core: vLLM-free, framework-free code (storage, retrieval, prompt, KV, the serve path);
- ``inferscale/serving/``: the only code that imports vLLM; it builds on the core;
- the application layer: the ``Memory`` facade and what is built on it (sessions, the
  LoCoMo loader, the demo, the CLI, the benchmarks); it wires core and serving.
Every import counts, lazy ones inside functions included.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "inferscale"
APPLICATION = ("inferscale", "inferscale.memory", "inferscale.answering", "inferscale.integration", "inferscale.async_memory", "inferscale.sessions",
               "inferscale.demo", "inferscale.cli", "inferscale.cli_bench", "inferscale.cli_common", "inferscale.datasets", "inferscale.bench", "inferscale.server",
               "inferscale.mcp_server")
FRAMEWORKS = ("vllm", "langchain", "langchain_core", "langchain_inferscale", "llama_index", "integrations")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names), at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def graph() -> dict[str, set[str]]:
    """Edges between inferscale modules (``from pkg import mod`` resolves to the module)."""
    mods = modules()
    return {name: {m for m in imports(path) if m in mods and m != name} for name, path in mods.items()}


def layer(name: str) -> str:
    if name == "inferscale.serving" or name.startswith("inferscale.serving."):
        return "serving"
    if any(name == a or name.startswith(a + ".") for a in APPLICATION[1:]) or name == "inferscale":
        return "application"
    return "core"


def is_framework(module: str) -> bool:
    return module.split(".")[0] in FRAMEWORKS


def test_only_serving_imports_vllm():
    offenders = {name for name, path in modules().items()
                 if any(m.split(".")[0] == "vllm" for m in imports(path)) and layer(name) != "serving"}
    assert not offenders, f"vLLM imported outside inferscale/serving/: {sorted(offenders)}"


def test_no_module_imports_langchain_or_llama_index():
    offenders = {name: sorted(m for m in imports(path) if is_framework(m) and m.split(".")[0] != "vllm")
                 for name, path in modules().items()}
    assert not {k: v for k, v in offenders.items() if v}, "frameworks belong in integrations/"


def test_layers_point_down_only():
    rank = {"core": 0, "serving": 1, "application": 2}
    upward = sorted(f"{a} -> {b}" for a, deps in graph().items() for b in deps if rank[layer(b)] > rank[layer(a)])
    assert not upward, f"imports that point up a layer (core < serving < application): {upward}"


def test_there_is_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_the_checks_catch_what_they_guard(tmp_path):
    """The graph helpers see lazy imports and ``from package import module``."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from inferscale.serving import engine\n    import vllm\n")
    found = imports(probe)
    assert "inferscale.serving.engine" in found and "vllm" in found
    assert layer("inferscale.kv.injection") == "core" and layer("inferscale.serving.connector") == "serving"
    assert layer("inferscale.bench.latency") == "application" and layer("inferscale.memory") == "application"


def test_architecture_module_map_names_every_module():
    """Each line of the map's code block starts with a path relative to ``inferscale/``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Module map", 1)[1].split("```")[1]
    listed = {m.group(1) for line in block.splitlines() if (m := re.match(r"^\s*([\w/]+\.py)\b", line))}
    listed.discard("__init__.py")
    files = {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if p.name != "__init__.py"}
    assert files - listed == set(), f"modules missing from docs/architecture.md's map: {sorted(files - listed)}"
    assert listed - files == set(), f"the map names modules that do not exist: {sorted(listed - files)}"


def test_no_module_outside_serving_imports_vllm_when_imported():
    """Measured, not parsed: a fresh interpreter imports every module outside ``serving/``
    (the front and the CLI included) and vLLM is still not in ``sys.modules``; a module may
    import vLLM inside a function that starts or drives an engine."""
    import subprocess
    import sys

    names = sorted(n for n in modules() if not (n == "inferscale.serving" or n.startswith("inferscale.serving.")))
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "    if 'vllm' in sys.modules:\n"
            "        print('IMPORTS-VLLM', name); break\n"
            "print('DONE', len(sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "IMPORTS-VLLM" not in done.stdout, done.stdout
    assert "DONE" in done.stdout and len(names) > 50


def test_the_connector_loads_a_small_part_of_the_package():
    """vLLM's engine process loads the connector: it needs the KV pool, rotation, injection
    and capture (and the (de)quantizer of 8- and 4-bit KV, the pool's tiers, the capture
    writer's step gate and process, the watch on its parent), not the settings,
    the model registry, prompts or tools."""
    import subprocess
    import sys

    code = ("import sys, inferscale.serving.connector\n"
            "print(sorted(m for m in sys.modules if m.startswith('inferscale')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(eval(done.stdout.strip().splitlines()[-1]))  # noqa: S307 - our own printed list
    assert loaded <= {"inferscale", "inferscale.runtime", "inferscale.runtime.devices", "inferscale.runtime.sizes",
                      "inferscale.runtime.logs", "inferscale.runtime.processes", "inferscale.kv",
                      "inferscale.kv.capture", "inferscale.kv.capture_writer", "inferscale.kv.injection", "inferscale.kv.pool", "inferscale.kv.disk_room", "inferscale.kv.quant", "inferscale.kv.rope",
                      "inferscale.kv.entry", "inferscale.kv.tiers", "inferscale.kv.disk",
                      "inferscale.kv.remote", "inferscale.serving",
                      "inferscale.serving.connector", "inferscale.serving.connector_stats", "inferscale.serving.orphans",
                      "inferscale.serving.step_gate"}, sorted(loaded)


def test_the_adapters_use_only_the_public_api_and_the_integration_module():
    """Issue 29: langchain-inferscale and llama-index-inferscale import ``inferscale`` and
    ``inferscale.integration`` only (their tests may reach further), and pin the 0.1 series."""
    allowed = {"inferscale", "inferscale.integration"}
    for path in sorted((ROOT / "integrations").rglob("*.py")):
        if "tests" in path.parts or "examples" in path.parts:
            continue
        used = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                used.add(node.module)
            elif isinstance(node, ast.Import):
                used.update(a.name for a in node.names)
        used = {m for m in used if m.split(".")[0] == "inferscale"}
        assert used <= allowed, f"{path.relative_to(ROOT)} imports {sorted(used - allowed)}"
    for project in sorted((ROOT / "integrations").glob("*/pyproject.toml")):
        assert '"inferscale>=0.1.0,<0.2"' in project.read_text(), project
