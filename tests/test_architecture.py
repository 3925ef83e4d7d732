"""The layering rules of docs/architecture.md, checked by reading ``tiered/`` with ``ast``.

Nothing is imported: each module's source is parsed, so a rule holds for every line of the
package, including code that only runs on a GPU or with an optional extra.

The rules:

* no import cycles between modules (imports under ``if TYPE_CHECKING:`` aside; an import inside
  a function counts, since it runs when the function does);
* tiers (``tiered.tiers``) never import codecs (``tiered.codecs``), nor codecs tiers;
* nothing below the facade (``tiered.store``) imports it or the package root;
* no module imports another module's private name, and no code reads another object's private
  attribute (``obj._name`` where ``obj`` is not ``self`` or ``cls``); ``tiered.testing`` may,
  since it is the one public place that looks inside a store.

How long a class or function is, is not a rule: classes and functions follow their job.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tiered"

# the modules above the facade (and their submodules): they use TieredStore as users do; the
# package root itself is checked by name (every module is a submodule of it)
ABOVE_FACADE = ("tiered.store", "tiered.cli", "tiered.__main__", "tiered.verify", "tiered.demo",
                "tiered.atari", "tiered.formats", "tiered.torchrl", "tiered.testing", "tiered.ray")
# where reading into private state is the job: the conformance suites and the inspection helper
MAY_LOOK_INSIDE = ("tiered.testing",)


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: list[str]
    imports: list[tuple[str, int]] = field(default_factory=list)  # (module, line)
    private_names: list[tuple[str, str, int]] = field(default_factory=list)  # (module, name, line)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _walk_runtime(node: ast.AST):
    """Every node, skipping the bodies of ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            yield from (n for stmt in child.orelse for n in [stmt, *_walk_runtime(stmt)])
            continue
        yield child
        yield from _walk_runtime(child)


def _load_modules() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        modules[_module_name(path)] = Module(_module_name(path), path, ast.parse(source), source.splitlines())
    names = set(modules)
    for m in modules.values():
        is_package = m.path.name == "__init__.py"
        for node in _walk_runtime(m.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "tiered":
                        m.imports.append((alias.name, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(m.name, is_package, node.level, node.module)
                if base.split(".")[0] != "tiered":
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in names:  # "from . import codecs": the submodule itself
                        m.imports.append((sub, node.lineno))
                    else:
                        m.imports.append((base, node.lineno))
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            m.private_names.append((base, alias.name, node.lineno))
    return modules


MODULES = _load_modules()


def _owner(name: str) -> str:
    """The defining module of an imported name: the longest known module prefix."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _below(name: str, parents: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in parents)


def test_the_package_is_read():
    assert len(MODULES) > 40 and "tiered.store" in MODULES and "tiered.engine.placement" in MODULES


def test_no_import_cycles():
    graph = {m: {_owner(t) for t, _ in mod.imports} - {m, ""} for m, mod in MODULES.items()}
    # importing "tiered.a.b" runs "tiered.a" first, but a package's __init__ importing its own
    # submodules is how packages work, not a cycle: edges into a package's own __init__ from below
    # are dropped
    for m, targets in graph.items():
        graph[m] = {t for t in targets if not m.startswith(t + ".")}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(("layer", "forbidden"), [("tiered.tiers", "tiered.codecs"),
                                                  ("tiered.codecs", "tiered.tiers")])
def test_tiers_and_codecs_do_not_know_each_other(layer, forbidden):
    bad = [f"{m.path.name}:{line} imports {target}" for m in MODULES.values() if _below(m.name, (layer,))
           for target, line in m.imports if _below(_owner(target), (forbidden,))]
    assert not bad, f"{layer} must not import {forbidden}:\n" + "\n".join(bad)


def test_nothing_below_the_facade_imports_it():
    bad = [f"{m.name}:{line} imports {target}" for m in MODULES.values()
           if m.name != "tiered" and not _below(m.name, ABOVE_FACADE)
           for target, line in m.imports if _owner(target) in ("tiered", "tiered.store")]
    assert not bad, "below the facade, nothing imports tiered.store or the package root:\n" + "\n".join(bad)


def test_inside_the_package_imports_name_the_defining_module():
    """Modules below the top import from the module that defines a name, never the package root."""
    bad = [f"{m.name}:{line}" for m in MODULES.values() if m.name not in ("tiered", "tiered.__main__")
           and not m.name.startswith("tiered.testing")
           for target, line in m.imports if target == "tiered"]
    assert not bad, "imports of the package root from inside it:\n" + "\n".join(bad)


def test_no_private_names_across_modules():
    bad = [f"{m.name}:{line} imports {name} from {base}" for m in MODULES.values()
           if not _below(m.name, MAY_LOOK_INSIDE)
           for base, name, line in m.private_names if _owner(base) != m.name]
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def test_no_private_attributes_of_other_objects():
    """``x._y`` only where ``x`` is ``self`` or ``cls`` (or a module's own private global)."""
    bad = []
    for m in MODULES.values():
        if _below(m.name, MAY_LOOK_INSIDE):
            continue
        imported_modules = {a.asname or a.name for n in ast.walk(m.tree) if isinstance(n, ast.Import)
                            for a in n.names}
        for node in ast.walk(m.tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            if node.attr in ALLOWED_FOREIGN:
                continue
            if isinstance(value, ast.Name) and value.id in imported_modules:
                bad.append(f"{m.name}:{node.lineno} {value.id}.{attr} (a private name of another module)")
                continue
            if _allowed_private_attribute(m, node):
                continue
            bad.append(f"{m.name}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "private attributes of other objects:\n" + "\n".join(bad)


# Private attributes of objects that are not ``self`` but that the reading module owns: the same
# class's other instance (``other._x`` inside the class that defines ``_x``), and the
# documented extension points of libraries tiered plugs into. Each entry says why.
ALLOWED_FOREIGN = {
    # TorchRL's Storage protocol: TensorStorage subclasses keep these, and TorchRL's own
    # checkpointers (which tiered.torchrl's checkpointer stands in for) read and set them
    "_attached_entities", "_checkpointer", "_len_along_dim0", "_storage", "_load_hooks", "_len",
    "_last_cursor", "_last_cursor_index", "_set_last_cursor", "_is_full",
    # PyTorch's API for tensor subclasses (the lazy column view of tiered.torchrl.views)
    "_make_wrapper_subclass", "_C",
    # collections.namedtuple's public methods are underscored so as not to clash with fields
    "_asdict", "_replace", "_fields", "_make",
}


def _allowed_private_attribute(module: Module, node: ast.Attribute) -> bool:
    # another instance of a class defined in this module, reaching into attributes that class sets
    return node.attr in _own_private_attributes(module.name)


_OWN_CACHE: dict[str, set[str]] = {}


def _own_private_attributes(name: str) -> set[str]:
    """Private attributes this module's own classes define (``self._x = ...`` or methods ``_x``)."""
    if name not in _OWN_CACHE:
        own: set[str] = set()
        for node in ast.walk(MODULES[name].tree):
            if isinstance(node, ast.ClassDef):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("_"):
                        own.add(sub.name)
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                            and isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")):
                        own.add(sub.attr)
                    if isinstance(sub, ast.AnnAssign | ast.Assign):
                        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                        own.update(t.id for t in targets if isinstance(t, ast.Name))
        _OWN_CACHE[name] = own
    return _OWN_CACHE[name]


def test_docstrings_and_comments_name_only_what_ships():
    bad = [f"{m.name}:{i + 1}" for m in MODULES.values() for i, line in enumerate(m.lines)
           if "DESIGN.md" in line or "shared/notes" in line]
    assert not bad, "references to files that do not ship with the package:\n" + "\n".join(bad)


def test_docs_tests_and_benchmarks_name_only_what_ships():
    # The repository is all a user has: pages, scripts and tests must not point outside it.
    root = PACKAGE.parent
    here = Path(__file__).resolve()
    files = [p for folder in ("docs", "tests", "benchmarks", "examples", "tools")
             for p in sorted((root / folder).rglob("*")) if p.suffix in (".py", ".md") and p != here]
    files += [root / "README.md", root / "CHANGELOG.md", root / "CONTRIBUTING.md"]
    bad = [f"{p.relative_to(root)}:{i + 1}" for p in files if p.is_file()
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines())
           if "DESIGN.md" in line or "shared/notes" in line]
    assert len(files) > 20
    assert not bad, "references to files that do not ship with the repository:\n" + "\n".join(bad)


def test_the_package_exports_every_exception():
    import tiered
    from tiered import errors

    missing = sorted(set(errors.__all__) - set(tiered.__all__))
    assert not missing, f"tiered.__all__ lacks {missing}"


# The folders of docs/architecture.md's diagram, top to bottom: a module imports only from its own
# box or the boxes below it.
LAYERS = (
    ("tiered.cli", "tiered.__main__", "tiered.demo", "tiered.verify", "tiered.formats", "tiered.torchrl",
     "tiered.ray", "tiered.testing", "tiered.atari", "tiered.prefetch", "tiered.sidecar"),
    ("tiered.store",),
    ("tiered.durable",),
    ("tiered.engine",),
    ("tiered.schema", "tiered.policy"),
    ("tiered.tiers", "tiered.codecs"),
    ("tiered.util", "tiered.errors", "tiered.version"),
)


def _layer(name: str) -> int | None:
    for i, box in enumerate(LAYERS):
        if _below(name, box):
            return i
    return None


def test_folders_import_only_downwards():
    upward = []
    for m in MODULES.values():
        here = _layer(m.name)
        if here is None:
            continue
        for target, line in m.imports:
            there = _layer(_owner(target))
            if there is not None and there < here:
                upward.append(f"{m.path.relative_to(PACKAGE.parent)}:{line} imports {target} (a box above)")
    assert not upward, "\n".join(upward)


def test_every_module_is_in_a_box():
    assert [m for m in MODULES if m != "tiered" and _layer(m) is None] == []
