"""The package's layering and size rules (docs/architecture.md), read from the source with ``ast``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = "lightning_async_pp"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
MAX_CLASS_LINES, MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_TOP_LEVEL_MODULES = 400, 500, 60, 6

# Known exceptions to the size rules, each with what would bring it under; the list only shrinks.
KNOWN_LONG: dict[str, str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def imported(name: str, tree: ast.Module | None = None) -> set[str]:
    """Every module ``name`` (parsed as ``tree``, default its source) imports, at module level, inside a function
    (a lazy import is a dependency too) or under ``if TYPE_CHECKING:`` (a type-only import ties the two modules
    together all the same: neither can be read, checked or moved without the other)."""
    is_package = MODULES[name].name == "__init__.py"
    out = set()
    for node in ast.walk(TREES[name] if tree is None else tree):
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


def internal_dependencies(name: str, tree: ast.Module | None = None) -> set[str]:
    deps = set()
    for target in imported(name, tree):
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
    """Type-only imports included: a helper that needs a type of its owner gets a protocol of its own instead."""
    cycles = find_cycles({name: internal_dependencies(name) for name in MODULES})
    assert not cycles, f"import cycles: {cycles}"


def test_a_type_only_import_is_a_dependency():
    planted = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_async_pp.runtime.stage import StageRuntime\n"
    )
    deps = internal_dependencies(f"{PACKAGE}.runtime.evaluation", planted)
    assert deps == {f"{PACKAGE}.runtime.stage"}


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


def qualified_nodes(tree: ast.Module, prefix: str):
    """Every class and function of ``tree`` with its dotted name (``module.Class.method``)."""
    stack = [(node, prefix) for node in tree.body]
    while stack:
        node, outer = stack.pop()
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{outer}.{node.name}"
            yield name, node
            stack.extend((child, name) for child in node.body)
        else:
            stack.extend((child, outer) for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))


def too_long(trees: dict[str, ast.Module], lines: dict[str, int] | None = None) -> list[str]:
    """Classes over ``MAX_CLASS_LINES``, functions over ``MAX_FUNCTION_LINES`` and modules (of ``lines`` lines)
    over ``MAX_MODULE_LINES``."""
    out = [
        f"{name}: {count} lines (at most {MAX_MODULE_LINES})"
        for name, count in (lines or {}).items()
        if count > MAX_MODULE_LINES
    ]
    for module, tree in trees.items():
        for name, node in qualified_nodes(tree, module):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            count = node.end_lineno - start + 1
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if count > limit:
                out.append(f"{name}: {count} lines (at most {limit})")
    return sorted(out)


def test_no_module_class_or_function_too_long():
    lines = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    offenders = [o for o in too_long(TREES, lines) if o.split(":")[0] not in KNOWN_LONG]
    assert not offenders, offenders


def test_the_known_long_ones_are_still_long():
    """An exception that was fixed leaves the list (so the list only shrinks)."""
    lines = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    long = {o.split(":")[0] for o in too_long(TREES, lines)}
    assert sorted(set(KNOWN_LONG) - long) == []


def test_top_level_modules():
    top_level = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top_level) <= MAX_TOP_LEVEL_MODULES, top_level


def test_the_checks_can_fail():
    """The helpers above find a cycle, a long function, class and module, a reach into another module's private
    attribute and a package object passed as ``Any`` when there is one."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    long_function = ast.parse("def f():\n" + body)
    long_class = ast.parse(
        "class C:\n" + "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_CLASS_LINES // 2))
    )
    assert too_long({"m": long_function}) == [f"m.f: {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})"]
    assert too_long({"m": long_class}) == [f"m.C: {MAX_CLASS_LINES + 1} lines (at most {MAX_CLASS_LINES})"]
    assert too_long({}, {"m": MAX_MODULE_LINES + 1}) == [
        f"m: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})"
    ]
    owner = ast.parse("class S:\n    def __init__(self):\n        self._runtime = None\n")
    reader = ast.parse("def f(strategy):\n    return strategy._runtime, self._own, torch._foreach_add\n")
    assert private_reaches({"owner": owner, "reader": reader}) == ["reader:2 strategy._runtime"]
    assert any_typed_package_objects({"m": ast.parse("def f(strategy: Any, n: Any): pass")}, {"strategy"}) == [
        "m.f(strategy: Any)"
    ]


# The private attributes of torch, Lightning and other libraries the package must use, each with its reason.
# Everything else named `X._name` (X not `self`/`cls`) must be defined in the module that reads it.
ALLOWED_PRIVATE = {
    "_orig_mod": "torch.compile's OptimizedModule: the module it compiled",
    "_fields": "a named tuple's field names, the documented way to tell one from a tuple",
    "_to_copy": "the aten op autocast casts a weight with, which plan counts apart from activations",
    "_adjust_lr": "torch.optim.Muon's learning-rate scale by matrix shape, applied by the batched step too",
    "_foreach_": "torch's fused multi-tensor ops (torch._foreach_*), which have no public equivalent",
    "_Unpickler": "pickle's Python unpickler, the one whose find_class a safe loader can override",
    "_StorageInfo": "torch.distributed.checkpoint's class, allowed by name when a checkpoint index is unpickled",
    "_parse_ckpt_path": "LightningCLI's hook, extended by the package's CLI",
    "_getframe": "sys._getframe: MetaLayers finds the module being constructed",
    "_attn_implementation": "a Hugging Face config's attention kernel, which has no public setter",
    "_is_hf_initialized": "Hugging Face's mark of a tensor its loader has already initialised",
    "_init_weights": "a Hugging Face model's per-module initialisation",
    "_zeropower_via_newtonschulz": "torch's Muon orthogonalisation, shared rather than copied",
    "_init_group": "torch optimizers' per-group state set-up, extended by Muon",
    "_is_profiler_enabled": "torch.autograd.profiler: label actions only while profiling",
    "_parameters": "nn.Module's parameter dict, to swap weight versions and re-tie weights without re-registering",
    "_modules": "nn.Module's children dict, to replace a layer that lives on another stage",
    "_version": "a tensor's in-place version counter (torch), which tells that a cached cast is stale",
    "_forward_hooks": "nn.Module's forward hooks, which a cached cast must not skip",
    "_forward_pre_hooks": "nn.Module's forward pre-hooks, which a cached cast must not skip",
    "_ensure_setup": "Lightning's AsyncCheckpointIO starts its executor lazily",
    "_executor": "Lightning's AsyncCheckpointIO's queue, to order a removal or a hand-over after the queued saves",
    "_checkpoint_io": "Lightning's checkpoint plugin wrapper, whose base plugin the strategy sets",
    "_base_checkpoint_io_configured": "Lightning's checkpoint plugin wrapper, told its base plugin is set",
    "_exit": "os._exit: a failed rank ends without running exit handlers that would hang",
    "_abort_process_group": "torch.distributed's abort of every group at once, as NCCL needs",
    "_get_default_store": "torch.distributed's store, on which the watchdog's heartbeat runs",
    "_collect_rank_zero_results": "Lightning's spawn launcher's hook, extended to gather every stage",
    "_num_samples": "a DistributedSampler's per-replica count, which a resumed epoch shortens",
    "_call_callback_hooks": "Lightning's call of the callbacks' hooks, run by a stage before each update",
    "_call_lightning_module_hook": "Lightning's call of the module's hooks, run by a stage before each update",
    "_results": "Lightning's logged results, which the metrics relay copies to the other stages",
    "_get_train_description": "Lightning's RichProgressBar's epoch text, replaced for max_epochs=-1",
    "_signal_connector": "Lightning's signal handlers, replaced so that SIGTERM needs no collective",
    "_broadcast_sigterm_tensor": "Lightning's per-step SIGTERM collective, replaced by the metrics relay",
    "_accelerator_connector": "Lightning's connector, which names the cluster environment",
    "_sigterm_notifier_fn": "Lightning's SIGTERM handler, replaced by one that only records the signal",
    "_slurm_sigusr_handler_fn": "Lightning's SLURM requeue handler, replaced by one that only records the signal",
    "_opt_called": "torch's flag that an optimizer stepped: the stage's first update comes after the scheduler's",
    "_max_depth": "Lightning's ModelSummary depth, kept by the pipeline summary that replaces it",
    "_compiled_call_impl": "torch.compile's wrapped forward, left out of the meta copy that counts FLOPs",
}


def _own_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: its functions and classes, class-body assignments, and attributes it
    sets on ``self`` or ``cls``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return names


def private_reaches(trees: dict[str, ast.Module]) -> list[str]:
    """Every ``X._name`` (read or written) where ``X`` is not ``self``/``cls`` and the module does not define
    ``_name`` itself, less :data:`ALLOWED_PRIVATE`."""
    out = []
    for module, tree in trees.items():
        own = _own_names(tree)
        for node in ast.walk(tree):
            reached = _reached_attribute(node)
            if reached is None or not reached.startswith("_") or reached.startswith("__"):
                continue
            if reached in own or any(reached.startswith(allowed) for allowed in ALLOWED_PRIVATE):
                continue
            out.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return sorted(out)


def _reached_attribute(node: ast.AST) -> str | None:
    """The attribute ``node`` reads or writes on another object: ``X.name``, or the literal name of
    ``getattr``/``hasattr``/``setattr(X, "name", ...)``; ``None`` for anything else and for ``self``/``cls``."""
    if isinstance(node, ast.Attribute):
        target, name = node.value, node.attr
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        target, name = node.args[0], node.args[1].value
    else:
        return None
    if isinstance(target, ast.Name) and target.id in ("self", "cls"):
        return None
    return name


def test_no_module_reaches_into_another_objects_private_attributes():
    offenders = private_reaches(TREES)
    assert not offenders, offenders


def test_a_reach_through_getattr_is_found():
    planted = ast.parse('placement = getattr(strategy, "_placement", None)\nstage = strategy.pipeline_stage\n')
    assert private_reaches({"m": planted}) == ["m:1 getattr(strategy, '_placement', None)"]


def package_object_names() -> set[str]:
    """The names a parameter holding one of the package's objects goes by: the snake_case of each class's name
    and of its trailing words (``AsyncPipelineStrategy``: ``strategy``, ``pipeline_strategy``, ...)."""
    names = set()
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                words = [w.lower() for w in re.findall(r"[A-Z][a-z0-9]*|[a-z0-9]+", node.name)]
                names.update("_".join(words[i:]) for i in range(len(words)) if len(words[i]) > 2)
    return names


def any_typed_package_objects(trees: dict[str, ast.Module], names: set[str]) -> list[str]:
    """Parameters annotated ``Any`` (or ``Any | None``) whose name says they hold one of the package's objects."""
    out = []
    for module, tree in trees.items():
        for qualified, node in qualified_nodes(tree, module):
            if isinstance(node, ast.ClassDef):
                continue
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for arg in arguments:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if annotation in ("Any", "Any | None") and arg.arg in names:
                    out.append(f"{qualified}({arg.arg}: {annotation})")
    return sorted(out)


# Words that name a user's or a library's object as often as one of the package's (a user's module, its output,
# a DataLoader), and parameters still to be typed, each with its reason.
GENERIC_NAMES = {"module", "output", "loader"}
KNOWN_ANY: dict[str, str] = {}


def test_no_package_object_is_passed_as_any():
    offenders = any_typed_package_objects(TREES, package_object_names() - GENERIC_NAMES)
    offenders = [o for o in offenders if o not in KNOWN_ANY]
    assert not offenders, offenders


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


# --------------------------------------------------------------------------- tests mirror the package

UNIT_TESTS = ROOT.parent / "tests" / "unit"

# Unit test files that test a behaviour spread over several modules, each with its reason; the list only shrinks.
CROSS_CUTTING_TESTS = {
    "test_architecture.py": "the layering and size rules, read from every module",
    "strategy/test_accumulation.py": "accumulate_grad_batches: the launch checks, the optimizer steps, one device",
    "strategy/test_bad_input.py": "the strategy's refusals of a bad model or batch, wherever they are raised",
    "strategy/test_lightning_pins.py": "the Lightning internals every strategy module relies on, and their bounds",
    "strategy/test_registration.py": "the name async_pp, registered by the package's __init__ and used by the CLI",
}


def unnamed_modules(test_files: list[str], modules: set[str]) -> list[str]:
    """The test files (``layer/test_x.py``, relative to ``tests/unit``) that name no module: ``layer/x.py``, or
    ``layer/m.py`` for ``test_m_aspect.py`` (one aspect of ``m``, say ``test_muon_batched.py``). A file at the top
    of ``tests/unit`` names a module at the top of the package. ``modules`` are paths relative to the package."""
    out = []
    for test in test_files:
        folder, _, name = test.rpartition("/")
        stem = name.removeprefix("test_").removesuffix(".py")
        words = stem.split("_")
        candidates = {"_".join(words[:n]) for n in range(1, len(words) + 1)}
        if not any(f"{folder}/{c}.py".lstrip("/") in modules for c in candidates):
            out.append(test)
    return out


def test_each_unit_test_file_names_the_module_it_tests():
    """So that a reader finds a module's tests at once: ``tests/unit/<layer>/test_<module>[_<aspect>].py``."""
    tests = sorted(str(p.relative_to(UNIT_TESTS)) for p in UNIT_TESTS.rglob("test_*.py"))
    modules = {str(p.relative_to(ROOT)) for p in MODULES.values()}
    offenders = [t for t in unnamed_modules(tests, modules) if t not in CROSS_CUTTING_TESTS]
    assert not offenders, f"name each after the module it tests, or list it in CROSS_CUTTING_TESTS: {offenders}"
    stale = sorted(set(CROSS_CUTTING_TESTS) - set(tests))
    assert not stale, f"CROSS_CUTTING_TESTS names files that do not exist: {stale}"


def test_the_test_naming_check_can_fail():
    modules = {"cli.py", "optim/muon.py", "runtime/stage.py"}
    tests = ["test_cli.py", "optim/test_muon_batched.py", "runtime/test_stage.py", "runtime/test_metrics_relay.py"]
    assert unnamed_modules(tests + ["test_command_line.py", "optim/test_optim_muon.py"], modules) == [
        "runtime/test_metrics_relay.py",
        "test_command_line.py",
        "optim/test_optim_muon.py",
    ]


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
