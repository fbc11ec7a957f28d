"""The docs stay true and readable: the README fits in one sitting, every relative link and
anchor resolves, no link leaves the repository, every ``memshard`` command of a code block is a
valid command line, and every source path and module name the prose gives exists in the code.

The names are read from the sources' syntax trees (nothing is imported): a backticked path
(``problem/pricing.py``, ``tests/unit/test_comm.py::test_x``, ``search/``), a dotted name from
a package or top-level module (``problem.pricing.build_problem``), a module by its file name
(``graph.Op``) and a class's member (``Plan.to_dict``).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from memshard.cli import build_parser
from memshard.core.errors import MemshardError
from tests.docs.markdown import ROOT, anchors, blocks, commands, links, page_name, pages, prose_of

SOURCE = ROOT / "src" / "memshard"
README_MAX_LINES = 300

# Sections of a page (page: (first heading, next heading)) whose names are not checked: none.
UNCHECKED_SECTIONS: dict[str, tuple[str, str]] = {}
# First parts of dotted names that are variables in the prose, not modules (``plan.memory``).
VARIABLES = {"plan", "model", "job", "mesh", "config", "sharded", "opt", "self"}
# Modules and folders that no longer exist: a name starting with one is stale.
REMOVED = {"ilp", "cost", "units", "selections", "storage_pricing", "exporting"}


def test_the_readme_fits_in_one_sitting():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move a topic to docs/"


@pytest.mark.parametrize("page", pages(), ids=page_name)
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # test_no_link_leaves_the_repository
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with this anchor in {page_name(file)}")
    assert not broken, broken


@pytest.mark.parametrize("page", pages(), ids=page_name)
def test_no_link_leaves_the_repository(page: Path):
    assert not [t for t in links(page) if re.match(r"[a-z]+:", t)]
    assert "http://" not in page.read_text() and "https://" not in page.read_text()


def docs_commands() -> list[tuple[str, str]]:
    return [(block.page, c) for page in pages() for block in blocks(page) for c in commands(block)]


def test_the_docs_have_commands():
    pages_with_commands = {page for page, _ in docs_commands()}
    assert {"README.md", "docs/guide.md", "docs/fit.md", "docs/runtime.md"} <= pages_with_commands


@pytest.mark.parametrize("page, command", docs_commands(), ids=[f"{p}: {c[9:60]}" for p, c in docs_commands()])
def test_every_command_is_a_valid_command_line(page: str, command: str):
    """Parsed by the command line's own parser, nothing run (the README's are run in
    test_readme.py, and the output blocks compared there)."""
    try:
        args = build_parser().parse_args(command.split()[1:])
    except MemshardError as e:
        pytest.fail(f"{page}: {command}: {e}")
    assert args.command == command.split()[1]


# -- the names the prose gives -------------------------------------------------------------------
@cache
def module_files() -> dict[str, Path]:
    """Dotted module name below memshard (``problem.pricing``; ``""`` for the package) → file."""
    out = {}
    for path in SOURCE.rglob("*.py"):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def assigned(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def members(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body defines: functions, classes, assignments, imports."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.If, ast.Try)):
            out.update(members(node.body))
        else:
            out.update({name: node for name in assigned(node)})
    return out


def class_members(node: ast.ClassDef) -> set[str]:
    """A class's members and the attributes its methods set on ``self``."""
    names = set(members(node.body))
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                and isinstance(sub.ctx, ast.Store):
            names.add(sub.attr)
    return names


def package_entry_points() -> set[str]:
    lazy = next(n for n in tree(SOURCE / "__init__.py").body if "_LAZY" in assigned(n))
    return {key.value for key in lazy.value.keys}


def resolves(module: str, rest: list[str]) -> bool:
    """Whether ``rest`` names something in ``module`` (its first part a module member, the
    second a class member; a deeper name is not followed)."""
    if not rest:
        return True
    path = module_files()[module]
    found = members(tree(path).body)
    if module == "":
        found |= {name: ast.Pass() for name in package_entry_points()}
    node = found.get(rest[0])
    if node is None:
        return False
    return len(rest) == 1 or not isinstance(node, ast.ClassDef) or rest[1] in class_members(node)


def name_resolves(name: str) -> bool:
    parts = name.removesuffix("()").split(".")
    modules = module_files()
    if parts[0] in REMOVED:
        return False
    if parts[0] == "memshard":
        parts = parts[1:]
        for k in range(len(parts), -1, -1):
            if ".".join(parts[:k]) in modules:
                return resolves(".".join(parts[:k]), parts[k:])
    for k in range(len(parts), 0, -1):  # a package or top-level module first: problem.pricing.build_problem
        if ".".join(parts[:k]) in modules:
            return resolves(".".join(parts[:k]), parts[k:])
    by_file = [m for m in modules if m.rsplit(".", 1)[-1] == parts[0]]  # graph.Op
    if by_file:
        return any(resolves(m, parts[1:]) for m in by_file)
    classes = classes_named().get(parts[0], [])  # Plan.to_dict
    return not classes or any(parts[1] in class_members(c) for c in classes)


@cache
def classes_named() -> dict[str, list[ast.ClassDef]]:
    out: dict[str, list[ast.ClassDef]] = {}
    for path in module_files().values():
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(node)
    return out


def path_resolves(token: str) -> bool:
    path, _, name = token.partition("::")
    if "/" not in path:  # a bare file name: one of the modules' files
        found = [p for p in (SOURCE, ROOT / "tests", ROOT / "benchmarks") for p in p.rglob(path)]
    else:
        found = [p for p in (ROOT / path, SOURCE / path) if p.exists()]
    if not found or not name:
        return bool(found)
    return any(name in members(tree(p).body) for p in found if p.suffix == ".py")


def without_unchecked_sections(page: Path, text: str) -> str:
    start, end = UNCHECKED_SECTIONS.get(page_name(page), (None, None))
    if start and start in text:
        text = text[:text.index(start)] + text[text.index(end, text.index(start)):]
    return text


def names_in(page: Path) -> tuple[list[str], list[str]]:
    """The backticked source paths and dotted names of a page's prose (no names from its
    UNCHECKED_SECTIONS)."""
    paths, names = [], []
    text = prose_of(page.read_text())
    named = set(re.findall(r"`([^`\n]+)`", without_unchecked_sections(page, text)))
    for token in re.findall(r"`([^`\n]+)`", text):
        if token.startswith("torch/"):
            continue  # PyTorch's own sources
        if re.fullmatch(r"[\w./-]+\.py(::\w+)?|[\w/]+/", token) or re.fullmatch(r"\w+/[\w./-]+\.(json|md)", token):
            paths.append(token)
        elif token in named and re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+(\(\))?", token) and token.split(".")[0] not in VARIABLES \
                and not re.search(r"\.(png|pdf|svg|json|md)$", token):
            names.append(token)
    return paths, names


@pytest.mark.parametrize("page", pages(), ids=page_name)
def test_every_path_and_name_in_the_prose_exists(page: Path):
    paths, names = names_in(page)
    missing = [p for p in paths if not path_resolves(p)] + [n for n in names if not name_resolves(n)]
    assert not missing, f"{page_name(page)} names what the code does not have: {missing}"


def test_the_name_check_can_fail():
    assert not name_resolves("ilp.solve.solve") and not name_resolves("problem.OpGroup")
    assert not name_resolves("plans.build_plan") and not name_resolves("Plan.no_such_field")
    assert name_resolves("search.solve.solve") and name_resolves("problem.records.OpGroup")
    assert name_resolves("graph.Op") and name_resolves("memshard.parallelize") and name_resolves("Plan.to_dict")
    assert not path_resolves("cost/") and not path_resolves("tests/test_cli.py")
    assert path_resolves("tests/planner/test_cli.py::test_plan_json_is_deterministic")
    assert not path_resolves("tests/planner/test_cli.py::test_no_such_test")
