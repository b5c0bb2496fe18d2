"""The package's layering and size rules (docs/architecture.md), read from the source with ``ast``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = "lightning_async_pp"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_TOP_LEVEL_MODULES, MAX_STRATEGY_LINES = 400, 80, 6, 450


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The import statements under ``if TYPE_CHECKING:``: a reference for the type checker, never run."""
    blocks = [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    return {node for block in blocks for stmt in block.body for node in ast.walk(stmt)}


def imported(name: str, type_checking: bool = True) -> set[str]:
    """Every module ``name`` imports, at module level or inside a function (a lazy import is a dependency too);
    with ``type_checking=False`` not those under ``if TYPE_CHECKING:``, which never run."""
    is_package = MODULES[name].name == "__init__.py"
    out = set()
    skipped = set() if type_checking else type_checking_only(TREES[name])
    for node in ast.walk(TREES[name]):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1] + ([node.module] if node.module else [])
                module = ".".join(base)
            else:
                module = node.module or ""
            # `from package import submodule` depends on the submodule; `from module import name` on the module.
            for alias in node.names:
                full = f"{module}.{alias.name}"
                out.add(full if full in MODULES else module)
    return out


def internal_dependencies(name: str, type_checking: bool = True) -> set[str]:
    deps = set()
    for target in imported(name, type_checking):
        parts = target.split(".")
        while parts and ".".join(parts) not in MODULES:
            parts.pop()
        dep = ".".join(parts)
        if parts and dep != name:
            deps.add(dep)
    return deps


def in_layer(name: str, layer: str) -> bool:
    return name == f"{PACKAGE}.{layer}" or name.startswith(f"{PACKAGE}.{layer}.")


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_import_cycle():
    # A class's typed reference back to its owner (the owner builds it) is imported for the type checker only.
    cycles = find_cycles({name: internal_dependencies(name, type_checking=False) for name in MODULES})
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("schedule", "torch"),
        ("schedule", "lightning"),
        ("runtime", "lightning"),
        ("reference", "lightning"),
        ("optim", "lightning_async_pp.runtime"),
        ("optim", "lightning_async_pp.strategy"),
        ("runtime", "lightning_async_pp.optim"),
        ("models", "lightning_async_pp.strategy"),
    ],
)
def test_layer_does_not_import(layer, forbidden):
    offenders = {
        name: sorted(t for t in imported(name) if t == forbidden or t.startswith(forbidden + "."))
        for name in MODULES
        if in_layer(name, layer)
    }
    offenders = {name: targets for name, targets in offenders.items() if targets}
    assert not offenders, f"{layer}/ must not import {forbidden}: {offenders}"


def test_only_the_strategy_layer_drives_lightning_pytorch():
    allowed = ("strategy", "module", "meta", "cli", "models", "demos", "checkpoint")
    offenders = [
        name
        for name in MODULES
        if any(t.startswith("lightning.pytorch") for t in imported(name))
        and not any(in_layer(name, layer) for layer in allowed)
        and name != PACKAGE
    ]
    assert not offenders, offenders


def test_nothing_outside_demos_imports_demos():
    offenders = [
        name
        for name in MODULES
        if not in_layer(name, "demos") and any(in_layer(dep, "demos") for dep in internal_dependencies(name))
    ]
    assert not offenders, offenders


def too_long(trees: dict[str, ast.Module]) -> list[str]:
    out = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - start + 1
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                if lines > limit:
                    out.append(f"{name}.{node.name}: {lines} lines (at most {limit})")
    return out


def test_no_class_or_function_too_long():
    offenders = too_long(TREES)
    assert not offenders, offenders


def test_top_level_modules_and_strategy_size():
    top_level = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top_level) <= MAX_TOP_LEVEL_MODULES, top_level
    defining = [p for p in MODULES.values() if "class AsyncPipelineStrategy(" in p.read_text()]
    assert len(defining) == 1
    assert len(defining[0].read_text().splitlines()) <= MAX_STRATEGY_LINES, defining[0]


def test_the_checks_can_fail():
    """The helpers above find a cycle, a long function and a long class when there is one."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    long_function = ast.parse("def f():\n" + body)
    long_class = ast.parse(
        "class C:\n" + "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_CLASS_LINES // 2))
    )
    assert too_long({"m": long_function}) == [f"m.f: {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})"]
    assert too_long({"m": long_class}) == [f"m.C: {MAX_CLASS_LINES + 1} lines (at most {MAX_CLASS_LINES})"]


DOC = ROOT.parent / "docs" / "architecture.md"


def layer_of(name: str) -> str:
    """A module's layer: its folder under the package, or itself for a module at the top level."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _text_blocks(section: str) -> list[str]:
    text = DOC.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```text\n(.*?)```", text, re.S)


def test_the_diagram_of_the_architecture_page_is_the_import_graph():
    drawn: dict[str, set[str]] = {}
    for line in _text_blocks("Import rules")[0].splitlines():
        sources, targets = (part.strip() for part in line.split("──>"))
        for source in sources.split(", "):
            drawn[source] = set() if targets.startswith("(nothing") else set(targets.split(", "))
    real: dict[str, set[str]] = {}
    for name in MODULES:
        real.setdefault(layer_of(name), set()).update(
            layer_of(dep) for dep in internal_dependencies(name) if layer_of(dep) != layer_of(name)
        )
    assert set(drawn) == set(real), f"layers drawn {sorted(drawn)}, in the package {sorted(real)}"
    wrong = {layer: (sorted(drawn[layer]), sorted(real[layer])) for layer in real if drawn[layer] != real[layer]}
    assert not wrong, f"layer: (drawn, imported): {wrong}"


def test_the_architecture_page_lists_every_module():
    listing = _text_blocks("Layers")[0]
    listed = set(re.findall(r"^ *([\w.]+\.py) ", listing, re.M))
    missing = [name for name, path in MODULES.items() if path.name != "__init__.py" and path.name not in listed]
    assert not missing, f"docs/architecture.md's file list lacks {missing}"


# --------------------------------------------------------------------------- schedules as classes

SCHEDULE_NAMES = ("2bw", "1f1b")  # the registry's names (tests/unit/schedule checks they are all of them)


def _names_a_schedule(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in SCHEDULE_NAMES
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_a_schedule(e) for e in node.elts)


def branches_on_schedule_name(trees: dict[str, ast.Module]) -> list[str]:
    """Comparisons (``==``, ``!=``, ``in``, ``match``) and tables (a dict keyed by name) that pick behaviour by a
    schedule's name. Passing the name as a value (``kind="1f1b"``) and docstrings are not branches."""
    out = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                found = any(_names_a_schedule(operand) for operand in (node.left, *node.comparators))
            elif isinstance(node, ast.MatchValue):
                found = _names_a_schedule(node.value)
            elif isinstance(node, ast.Dict):
                found = any(key is not None and _names_a_schedule(key) for key in node.keys)
            else:
                continue
            if found:
                out.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_branch_on_a_schedule_name():
    """What differs between schedules is asked of the kind's class (``schedule.get_schedule(name)``), never
    decided by comparing its name, in any layer: a new schedule is then one new class."""
    offenders = branches_on_schedule_name(TREES)
    assert not offenders, f"ask get_schedule(name) instead of comparing the name: {offenders}"


def test_the_schedule_name_check_can_fail():
    planted = {
        "compare": ast.parse('if kind == "2bw":\n    pass'),
        "member": ast.parse('x = 2 if kind in ("1f1b", "gpipe") else 1'),
        "match": ast.parse('match kind:\n    case "2bw":\n        pass'),
        "table": ast.parse('BUFFERS = {"2bw": 2, "1f1b": 1}'),
        "value": ast.parse('f(kind="1f1b")\n"""Docs name "2bw"."""'),
    }
    found = {line.split(":")[0] for line in branches_on_schedule_name(planted)}
    assert found == {"compare", "member", "match", "table"}
