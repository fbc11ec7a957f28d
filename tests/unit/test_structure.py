"""The code's shape: data flows one way (CLI → API → job → problem → search → plan → report;
runtime ← plan), no import cycle (function-level imports counted), no private name used
outside its module, no function over 80 lines, and a planner core without torch."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src" / "memshard"
MAX_FUNCTION_LINES = 80

# A module may import modules of its own layer or below (package prefixes match submodules).
LAYERS = [
    ("memshard.core",),
    ("memshard.models", "memshard.trace"),
    ("memshard.job",),
    ("memshard.problem",),
    ("memshard.baselines",),
    ("memshard.search",),
    ("memshard.plans",),
    ("memshard.planner", "memshard.runtime"),
    ("memshard.api", "memshard.pareto", "memshard.fitting", "memshard.pipelining"),
    ("memshard.cli",),
    ("memshard",),  # the package's lazy entry points
]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SOURCE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, depth = None, -1
    for k, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and name.count(".") > depth:
                best, depth = k, name.count(".")
    assert best is not None, f"{module} has no layer: add it to LAYERS"
    return best


def imports_of(path: pathlib.Path, module: str) -> list[tuple[str, list[str]]]:
    """(imported memshard module, names taken from it) for every import in the file, at any depth."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("memshard")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("memshard"):
                continue
            for a in node.names:  # ``from memshard.search import solve`` may name a submodule
                sub = f"{base}.{a.name}"
                out.append((sub, []) if sub in MODULES else (base, [a.name]))
    return [(name, names) for name, names in out if name in MODULES]


GRAPH = {m: imports_of(p, m) for m, p in MODULES.items()}


def test_every_module_has_a_layer_and_imports_none_above_it():
    upward = [f"{m} (layer {layer_of(m)}) imports {dep} (layer {layer_of(dep)})"
              for m, deps in GRAPH.items() for dep, _ in deps if layer_of(dep) > layer_of(m)]
    assert not upward, "\n".join(upward)


def find_cycles(edges: dict[str, list[str]]) -> list[str]:
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for dep in edges.get(m, []):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycle():
    cycles = find_cycles({m: sorted({dep for dep, _ in deps if dep != m}) for m, deps in GRAPH.items()})
    assert not cycles, "\n".join(cycles)


def test_the_checks_can_fail():
    """The cycle search finds a cycle, and the import walk sees function-level imports."""
    assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a -> b -> c -> a"]
    assert any(dep == "memshard.trace.hf" for dep, _ in GRAPH["memshard.job"])  # inside Job.graph
    assert layer_of("memshard.cli") > layer_of("memshard.api") > layer_of("memshard.planner") > layer_of("memshard.plans.plan")


def python_files() -> list[pathlib.Path]:
    return [*SOURCE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]


def test_no_private_name_is_used_outside_its_module():
    found = []
    for path in python_files():
        tree = ast.parse(path.read_text())
        memshard_aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memshard"):
                for a in node.names:
                    if a.name.startswith("_"):
                        found.append(f"{path}:{node.lineno} imports {node.module}.{a.name}")
                    if f"{node.module}.{a.name}" in MODULES:
                        memshard_aliases.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                memshard_aliases |= {a.asname or a.name for a in node.names if a.name.startswith("memshard")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in memshard_aliases):
                found.append(f"{path}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not found, "\n".join(found)


def test_no_function_is_over_80_lines():
    long = []
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)


CORE = sorted(m for m in MODULES if not m.startswith(("memshard.runtime", "memshard.trace")))


@pytest.mark.parametrize("chunk", [CORE[: len(CORE) // 2], CORE[len(CORE) // 2:]])
def test_the_planner_core_imports_no_torch(chunk):
    code = ("import importlib, sys\n"
            f"for m in {chunk!r}: importlib.import_module(m)\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"]


def test_the_cli_knob_flags_are_the_jobs_knobs():
    from memshard.cli import KNOB_FLAGS
    from memshard.job import MODEL_KNOBS

    assert list(KNOB_FLAGS) == list(MODEL_KNOBS)


MAX_TOP_LEVEL_MODULES = 8


def test_the_package_is_folders_with_few_modules_at_the_top():
    """Concepts live in folders (the layers above); at most 8 modules sit at the top level."""
    top = sorted(p.stem for p in SOURCE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    folders = {p.parent.name for p in SOURCE.glob("*/__init__.py")}
    assert {"core", "problem", "baselines", "search", "plans"} <= folders
    for folder in folders:  # each folder says what it owns
        assert ast.get_docstring(ast.parse((SOURCE / folder / "__init__.py").read_text())), folder
