"""The layers stay one-way: every module imports on its own, and passes know nothing of fxpipe."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


def test_every_module_imports_on_its_own_in_a_fresh_interpreter() -> None:
    # torch is imported once, then each module is imported in a fork that has loaded no
    # fxpipe module yet: a cycle shows up only when its own module is imported first
    script = (
        "import os, sys, traceback, torch, torch.fx, torch.distributed\n"
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
    for name in ("schedules.py", "schedule_sim.py"):
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
