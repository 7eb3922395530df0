"""The tree is the architecture and its layers stay one-way: fxpipe/ keeps at its top only
what a user names, beside one room per layer (batching, compiler, planner, runtime,
distributed, inspection); every module imports on its own; passes know nothing of fxpipe;
the runtimes import no pass and not each other; the compiler imports no pipeline; the
planner and inspection import no runtime; and no module imports itself back through others
(no cycles, counting the imports made inside functions)."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def _modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "fxpipe").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    for path in sorted((ROOT / "passes").glob("*.py")):
        stem = path.stem
        names.append("fxpipe.passes" if stem == "__init__" else f"fxpipe.passes.{stem}")
    return [n for n in names if not n.endswith("__main__")]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "passes":
        parts = ("fxpipe", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    paths = sorted((ROOT / "fxpipe").rglob("*.py")) + sorted((ROOT / "passes").glob("*.py"))
    return {_module_name(p): p for p in paths}


def _all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports when it runs, at module level or inside a function (an
    ``if TYPE_CHECKING:`` block, which never runs, left out); ``from pkg import mod`` counts
    as an import of ``pkg.mod`` when that is a module."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for n in ast.walk(block)
    }
    modules = _sources()
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found


@functools.cache
def _import_graph() -> nx.DiGraph:
    """fxpipe's modules, an edge from each to every fxpipe module it imports."""
    modules = _sources()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        graph.add_edges_from((name, target) for target in _all_imports(path) if target in modules and target != name)
    return graph


def _reached(module: str) -> set[str]:
    """The fxpipe modules that importing ``module`` (and running its functions) may load."""
    return nx.descendants(_import_graph(), module)


def _matching(prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in _import_graph() if any(m == p or m.startswith(p + ".") for p in prefixes))


PASSES = ("fxpipe.passes",)
# the pass driver and the one module that builds pipelines from its result
COMPILER = ("fxpipe.compiler.driver", "fxpipe.factory")
PIPELINES = ("fxpipe.factory", "fxpipe.runtime", "fxpipe.distributed")
# one stage's runner and what it runs with: the compiler's memory profile runs it on fake tensors
STAGE_RUNTIME = (
    "fxpipe.runtime.runner", "fxpipe.runtime.context", "fxpipe.runtime.memory", "fxpipe.runtime.offload",
    "fxpipe.runtime.recompute", "fxpipe.runtime.finite", "fxpipe.runtime.streams", "fxpipe.runtime.placement",
    "fxpipe.runtime.compiled", "fxpipe.runtime.split_backward",
)
LOCAL_RUNTIME = ("fxpipe.runtime.local_pipeline", "fxpipe.runtime.local")
DISTRIBUTED_RUNTIME = ("fxpipe.distributed",)
# the rooms of fxpipe/: what the tree says the architecture is
ROOMS = ("batching", "compiler", "distributed", "inspection", "planner", "runtime")
TOP_LEVEL_LIMIT = 15


def test_no_import_cycles_even_through_imports_inside_functions() -> None:
    cycles = [sorted(c) for c in nx.strongly_connected_components(_import_graph()) if len(c) > 1]
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"


@pytest.mark.parametrize("module", _matching(("fxpipe.runtime", "fxpipe.distributed", "fxpipe.runtime.local_pipeline")))
def test_runtimes_import_no_pass_and_not_each_other(module: str) -> None:
    reached = _reached(module)
    bad = sorted(m for m in reached if m in _matching(PASSES + COMPILER))
    assert not bad, f"{module} reaches {bad}: the runtimes get what they need of the compiler handed in (fxpipe.factory)"
    if module in _matching(DISTRIBUTED_RUNTIME):
        other = _matching(LOCAL_RUNTIME)
    elif module in _matching(LOCAL_RUNTIME):
        other = _matching(DISTRIBUTED_RUNTIME)
    else:
        other = _matching(LOCAL_RUNTIME + DISTRIBUTED_RUNTIME)
    crossing = sorted(reached & set(other))
    assert not crossing, f"{module} reaches {crossing}: the local and the distributed runtime share only fxpipe.runtime"


def test_the_compiler_imports_no_pipeline() -> None:
    for module in _matching(("fxpipe.compiler", "fxpipe.planner")):
        bad = sorted(m for m in _reached(module) if m in _matching(PIPELINES) and m not in STAGE_RUNTIME)
        assert not bad, f"{module} reaches {bad}: only fxpipe.factory builds pipelines"


@pytest.mark.parametrize("module", _matching(("fxpipe.inspection", "fxpipe.inspection.timeline")))
def test_drawings_and_timelines_import_no_executor_and_plot_lazily(module: str) -> None:
    bad = sorted(m for m in _reached(module) if m in _matching(PIPELINES))
    assert not bad, f"{module} reaches {bad}: drawings read the partition and the recorded events only"
    tree = ast.parse(_sources()[module].read_text())
    top = [n for stmt in tree.body if not isinstance(stmt, ast.FunctionDef | ast.ClassDef) for n in ast.walk(stmt)]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names} | {n.module for n in top if isinstance(n, ast.ImportFrom)}
    eager = sorted(name for name in names if name and name.split(".")[0] in ("matplotlib", "graphviz"))
    assert not eager, f"{module} imports {eager} at module level: load them only when a picture is asked for"


def test_runtime_functions_stay_short_and_dispatch_actions_in_one_place() -> None:
    runtime = _matching(("fxpipe.runtime", "fxpipe.distributed", "fxpipe.runtime.local_pipeline"))
    long = [
        f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name in runtime
        for node in ast.walk(ast.parse(_sources()[name].read_text()))
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long, f"runtime functions over 60 lines: {long}"
    dispatching = [name for name in runtime if 'op == "B"' in _sources()[name].read_text()]
    assert dispatching == ["fxpipe.runtime.interpret"], f"F/B/I/W dispatched in {dispatching}: use runtime.interpret.dispatch"


def test_no_two_modules_share_a_name() -> None:
    stems: dict[str, list[str]] = {}
    for name, path in _sources().items():
        if path.stem not in ("__init__", "__main__"):
            stems.setdefault(path.stem, []).append(name)
    shared = {stem: names for stem, names in stems.items() if len(names) > 1}
    assert not shared, f"modules named alike say less than their role: {shared}"


def test_importing_fxpipe_loads_no_distributed_module() -> None:
    script = "import sys, fxpipe; print(sorted(m for m in sys.modules if m.startswith('fxpipe.distributed')))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", check=True)
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.slow
def test_every_module_imports_on_its_own_in_a_fresh_interpreter() -> None:
    # torch (and the other libraries fxpipe imports: Dynamo, networkx, sympy) is imported
    # once, then each module is imported in a fork that has loaded no fxpipe module yet: a
    # cycle shows up only when its own module is imported first (a fork without the
    # libraries took 1.5 s a module, 3 minutes in all)
    script = (
        "import os, sys, traceback, torch, torch.fx, torch.distributed, torch._dynamo, networkx, sympy\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    r, w = os.pipe()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.close(r)\n"
        "        try:\n"
        "            __import__(name)\n"
        "            os._exit(0)\n"
        "        except BaseException:\n"
        "            os.write(w, traceback.format_exc().strip().splitlines()[-1].encode())\n"
        "            os._exit(1)\n"
        "    os.close(w)\n"
        "    message = os.read(r, 4096).decode()\n"
        "    os.close(r)\n"
        "    if os.waitpid(pid, 0)[1]:\n"
        "        failed.append(f'{name}: {message}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, *_modules()], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "passes").glob("*.py")), ids=lambda p: p.name)
def test_passes_import_torch_networkx_and_themselves_only(path: Path) -> None:
    allowed = ("torch", "networkx", "fxpipe.passes")
    bad = sorted(
        name
        for name in _imports(path)
        if name.split(".")[0] not in STDLIB and not any(name == a or name.startswith(a + ".") for a in allowed)
    )
    assert not bad, f"{path.name} imports {bad}: passes may import torch, networkx and fxpipe.passes only"


def test_schedules_import_no_torch() -> None:
    for name in ("schedules.py", "planner/schedule_sim.py", "planner/memory_model.py"):
        imports = _imports(ROOT / "fxpipe" / name)
        assert not any(i.split(".")[0] == "torch" for i in imports), f"fxpipe/{name} imports torch: {imports}"


def test_top_level_passes_name_is_not_installed() -> None:
    result = subprocess.run([sys.executable, "-c", "import passes"], capture_output=True, text=True, cwd="/")
    assert result.returncode != 0, "a top-level 'passes' package is importable: it would clash with other projects"


def test_pyproject_lists_every_package() -> None:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fxpipe").rglob("__init__.py")}
    assert found | {"fxpipe.passes"} == listed, f"pyproject.toml [tool.setuptools] packages must list {sorted(found)}"


def test_the_top_level_holds_only_what_a_user_names() -> None:
    top = sorted(p.name for p in (ROOT / "fxpipe").glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, f"fxpipe/ holds {len(top)} modules at its top (at most {TOP_LEVEL_LIMIT}): {top}"
    rooms = sorted(p.parent.name for p in (ROOT / "fxpipe").glob("*/__init__.py"))
    assert rooms == sorted(ROOMS), f"fxpipe/'s subpackages {rooms} are not the architecture's rooms {sorted(ROOMS)}"


@pytest.mark.parametrize("room", ROOMS)
def test_every_room_says_what_it_holds(room: str) -> None:
    doc = ast.get_docstring(ast.parse((ROOT / "fxpipe" / room / "__init__.py").read_text()))
    assert doc and len(doc) > 80, f"fxpipe/{room}/__init__.py needs a docstring that says what the room holds"
    assert f"fxpipe/{room}/" in (ROOT / "docs" / "architecture.md").read_text(), f"docs/architecture.md does not draw fxpipe/{room}/"


def test_every_public_name_and_documented_import_path_still_works() -> None:
    import fxpipe

    missing = [name for name in fxpipe.__all__ if not hasattr(fxpipe, name)]
    assert not missing, f"fxpipe.__all__ names missing: {missing}"
    paths = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        paths.update(re.findall(r"\b(?:from|import) (fxpipe(?:\.\w+)+)", doc.read_text()))
    broken = []
    for path in sorted(paths):
        try:
            importlib.import_module(path)
        except ImportError as err:
            broken.append(f"{path}: {err}")
    assert not broken, f"import paths the docs show that no longer import: {broken}"
