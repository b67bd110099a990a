"""The package's shape, checked from its source (docs/ARCHITECTURE.md).

- Layers: every import of a jaxlight module goes to the importer's layer or one below it, by the layer
  table of ``docs/ARCHITECTURE.md``, which this file parses (the table's only copy). Every module is in
  the table and every entry of it names a module that exists.
- No runtime import cycle inside ``jaxlight/``: every ``import`` counts, at module level or inside a
  function; only the body of ``if TYPE_CHECKING:`` does not. Importing ``a.b.c`` from outside the package
  ``a.b`` also runs ``a/b/__init__.py``, so it counts as an import of that package too.
- No private API of jax, jaxlib, optax, orbax or flax outside ``jaxlight/compat.py``: no module path with
  a ``_``-prefixed part (``jax._src``, ``optax._src``, ``orbax.checkpoint._src``), no ``_``-prefixed
  attribute of those libraries, and none of the reads that reach inside their objects
  (``__closure__``, ``cell_contents``, ``._async_manager``, ...).
- ``jaxlight.strategies`` imports neither ``jaxlight.nn`` nor the step, the engine, the planner or the trainer.
- No module over 900 lines, ``trainer.py`` at most 500.

Nothing is imported: the modules are parsed with ``ast``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxlight"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
COMPAT = "jaxlight.compat"

PRIVATE_LIBS = ("jax", "jaxlib", "optax", "orbax", "flax")
# Reads that reach inside another library's objects (closures, orbax's checkpointer internals): they break
# silently when the library is refactored, so only compat.py may do them, each with a test.
PRIVATE_ATTRS = frozenset({"__closure__", "cell_contents", "co_freevars", "_async_manager"})

MAX_LINES = 900
MAX_TRAINER_LINES = 500


# ---------------------------------------------------------------------------- reading the package
def _modules() -> dict[str, Path]:
    """``{"jaxlight.strategies.placement": path}`` for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside the body of an ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            for stmt in node.body:
                out.update(id(n) for n in ast.walk(stmt))
    return out


def _runtime_imports(module: str, tree: ast.AST, names: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of every import outside ``if TYPE_CHECKING:``; ``from a import b`` gives
    ``a.b`` when that is a module of the package (or ``names`` is set), else ``a``. Relative imports are
    resolved."""
    skip = _type_checking_nodes(tree)
    package = module if _is_package(module) else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                full = f"{target}.{a.name}"
                out.append((node.lineno, full if names or full in MODULES else target))
    return out


def _owner(name: str) -> str | None:
    """The package module that ``name`` (a module or an object in one) is."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` for runtime imports inside the package."""
    graph: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for line, name in _runtime_imports(module, tree):
            target = _owner(name)
            if target is None or target == module:
                continue
            targets = [target]
            # importing a.b.c runs a/b/__init__.py first: an import of the package a.b too, unless the
            # importer is inside a.b (then a.b is already being imported)
            parts = target.split(".")
            for i in range(2, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg in MODULES and not (module == pkg or module.startswith(pkg + ".")):
                    targets.append(pkg)
            for t in targets:
                if t != module and t != "jaxlight":  # the root package imports everything, nothing imports it back
                    graph[module].setdefault(t, line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, comp) for comp in components]


def _cycle_through(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One closed path inside ``component`` starting at its first module (breadth-first back to it)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return component  # pragma: no cover - a component always holds a cycle


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join([*steps, cycle[-1]])


# ---------------------------------------------------------------------------- layers
def layer_table(text: str) -> list[tuple[str, list[str]]]:
    """``(layer, entries)`` per row of the table under ``## Layers`` in ``text``, bottom up: the backquoted
    paths of its modules column (``errors``, ``callbacks/callback.py``, ``strategies/``)."""
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not re.match(r"\d+\.", cells[0]):
            continue  # prose, the header, the |---| line
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return rows


def _entry_module(entry: str) -> str:
    """The dotted name an entry of the table names: ``callbacks/`` -> ``jaxlight.callbacks``."""
    if entry == "__init__.py":
        return "jaxlight"
    path = entry.rstrip("/").removesuffix(".py").replace("/", ".")
    return f"jaxlight.{path}"


def layer_map(rows: list[tuple[str, list[str]]], modules: dict[str, Path]) -> tuple[dict[str, int], list[str]]:
    """``({module: layer index}, problems)``: each module takes the layer of the most specific entry that
    covers it (``x/`` covers the package ``x`` and everything in it; ``x`` and ``x.py`` only that module).
    Problems: an entry naming no module, an entry listed twice, a module no entry covers."""
    problems = []
    exact: dict[str, int] = {}
    packages: dict[str, int] = {}
    for i, (name, entries) in enumerate(rows):
        for entry in entries:
            target = _entry_module(entry)
            table = packages if entry.endswith("/") else exact
            if target not in modules or (entry.endswith("/") and modules[target].name != "__init__.py"):
                problems.append(
                    f"layer {name!r} lists `{entry}`, which is no {'package' if table is packages else 'module'} of jaxlight/"
                )
            elif target in table:
                problems.append(f"`{entry}` is listed twice (layers {rows[table[target]][0]!r} and {name!r})")
            else:
                table[target] = i
    out = {}
    for module in modules:
        if module in exact:
            out[module] = exact[module]
            continue
        owners = [p for p in packages if module == p or module.startswith(p + ".")]
        if owners:
            out[module] = packages[max(owners, key=len)]
        else:
            problems.append(f"{module} is in no layer of the table: add it to docs/ARCHITECTURE.md")
    return out, problems


def upward_imports(graph: dict[str, dict[str, int]], layers: dict[str, int], names: list[str]) -> list[str]:
    """``"a (layer) imports b (layer) at line n"`` for every import in ``graph`` that goes up a layer."""
    return [
        f"{m} ({names[layers[m]]}) imports {t} ({names[layers[t]]}) at line {line}"
        for m, targets in sorted(graph.items())
        for t, line in targets.items()
        if m in layers and t in layers and layers[t] > layers[m]
    ]


# ---------------------------------------------------------------------------- private APIs
def _private_part(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] in PRIVATE_LIBS and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(names)])
    return None


def private_uses(path: Path, root: Path = ROOT) -> list[str]:
    """``"file:line: what"`` (relative to ``root``) for every private-API use in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(root)
    found = []
    aliases: dict[str, str] = {}  # local name -> the library module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PRIVATE_LIBS:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if _private_part(a.name):
                    found.append(f"{rel}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] not in PRIVATE_LIBS:
                continue
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                if _private_part(node.module) or _private_part(f"{node.module}.{a.name}"):
                    found.append(f"{rel}:{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRS:
                found.append(f"{rel}:{node.lineno}: reads .{node.attr}")
                continue
            dotted = _dotted(node)
            if dotted is not None:
                head, _, tail = dotted.partition(".")
                if head in aliases and _private_part(f"{aliases[head]}.{tail}"):
                    found.append(f"{rel}:{node.lineno}: uses {dotted}")
        elif isinstance(node, ast.Call) and node.args:
            fn = _dotted(node.func) or ""
            arg = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
            if fn.endswith("import_module") or fn == "__import__":
                if isinstance(arg, str) and _private_part(arg):
                    found.append(f"{rel}:{node.lineno}: imports {arg!r}")
            elif fn in ("getattr", "hasattr", "setattr") and len(node.args) > 1:
                name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
                if name in PRIVATE_ATTRS:
                    found.append(f"{rel}:{node.lineno}: {fn}(..., {name!r})")
    # an attribute read inside a larger chain is visited twice (jax._src.x, jax._src): report each line once
    return sorted(set(found))


# ---------------------------------------------------------------------------- the tests
def test_no_runtime_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "runtime import cycles inside jaxlight/ (imports inside functions count):\n" + "\n".join(
        "  " + _describe(graph, c) for c in cycles
    )


def test_strategies_sit_below_nn_and_the_engine():
    # nn/ reads what a strategy piece installs (attention exchange, pipeline schedule), so nn imports
    # strategies and never the reverse; the planner ("auto") drives the engine, so it sits above both
    above = ("jaxlight.nn", "jaxlight.engine", "jaxlight.planner", "jaxlight.trainer", "jaxlight.step")
    graph = import_graph()
    wrong = [
        f"{m} imports {t} (line {line})"
        for m, targets in graph.items()
        if m == "jaxlight.strategies" or m.startswith("jaxlight.strategies.")
        for t, line in targets.items()
        if any(t == a or t.startswith(a + ".") for a in above)
    ]
    assert not wrong, "jaxlight.strategies must not import the layers above it:\n" + "\n".join(wrong)


def test_the_cycle_check_sees_what_it_must():
    # a function-level import and a package __init__ count; a TYPE_CHECKING import does not
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from jaxlight.trainer import Trainer\nelse:\n    import jaxlight.data\n"
        "def f():\n    from jaxlight.engine import Engine\n"
    )
    names = [n for _, n in _runtime_imports("jaxlight.planner", tree)]
    assert "jaxlight.trainer" not in names and {"jaxlight.data", "jaxlight.engine"} <= set(names)
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    # importing jaxlight.strategies.pipeline from nn/ runs jaxlight/strategies/__init__.py too
    assert {"jaxlight.strategies.pipeline", "jaxlight.strategies"} <= set(import_graph()["jaxlight.nn.layer_stack"])


def test_imports_follow_the_layer_table():
    rows = layer_table(ARCHITECTURE.read_text())
    assert len(rows) >= 5, f"docs/ARCHITECTURE.md: found {len(rows)} rows in the Layers table, expected the layers"
    layers, problems = layer_map(rows, MODULES)
    assert not problems, "the Layers table of docs/ARCHITECTURE.md does not match jaxlight/:\n" + "\n".join(
        "  " + p for p in problems
    )
    up = upward_imports(import_graph(), layers, [name for name, _ in rows])
    assert not up, (
        f"{len(up)} imports go up a layer (docs/ARCHITECTURE.md, Layers; imports inside functions count, "
        "TYPE_CHECKING ones do not): pass what a higher layer knows in as an argument, or move the piece down\n"
        + "\n".join("  " + u for u in up)
    )


def concrete_callback_imports(layers: dict[str, int]) -> list[str]:
    """Imports of a concrete callback (anything of ``jaxlight.callbacks`` but the ``Callback`` base) by a
    module below the facade outside ``callbacks/``: loop code knows callbacks by their declared capabilities."""
    facade = layers["jaxlight.trainer"]
    base = ("jaxlight.callbacks.callback", "jaxlight.callbacks.Callback")
    found = []
    for module, path in MODULES.items():
        if (
            layers.get(module, facade) >= facade
            or module == "jaxlight.callbacks"
            or module.startswith("jaxlight.callbacks.")
        ):
            continue
        for line, name in _runtime_imports(module, ast.parse(path.read_text(), str(path)), names=True):
            if name.startswith("jaxlight.callbacks.") and not any(name == b or name.startswith(b + ".") for b in base):
                found.append(f"{module}:{line} imports {name}")
    return found


def test_loop_code_knows_capabilities_not_callback_classes():
    rows = layer_table(ARCHITECTURE.read_text())
    layers, _ = layer_map(rows, MODULES)
    found = concrete_callback_imports(layers)
    assert not found, (
        "below the facade only callbacks/ names a concrete callback: declare a capability on "
        "jaxlight.callbacks.Callback and read it instead (the default callbacks are in default_callbacks.py):\n"
        + "\n".join("  " + f for f in found)
    )
    # the check sees a function-level import of a concrete callback, by name from the package too
    tree = ast.parse("def f():\n    from jaxlight.callbacks import Preemption, Callback\n")
    assert [n for _, n in _runtime_imports("jaxlight.loops", tree, names=True)] == [
        "jaxlight.callbacks.Preemption",
        "jaxlight.callbacks.Callback",
    ]


def test_the_layer_check_sees_what_it_must():
    doc = (
        "# x\n## Layers\n\nprose with `data` in backquotes\n\n| layer | modules | what |\n|---|---|---|\n"
        "| 0. low | `errors`, `callbacks/callback.py` | the `Callback` base |\n"
        "| 1. high | `callbacks/`, `engine`, `nowhere.py`, `errors` | x |\n\n## Modules\n| `trainer` | y |\n"
    )
    rows = layer_table(doc)
    assert rows == [
        ("0. low", ["errors", "callbacks/callback.py"]),
        ("1. high", ["callbacks/", "engine", "nowhere.py", "errors"]),
    ]
    modules = {
        m: MODULES[m]
        for m in (
            "jaxlight.errors",
            "jaxlight.callbacks",
            "jaxlight.callbacks.callback",
            "jaxlight.callbacks.timer",
            "jaxlight.engine",
            "jaxlight.hooks",
        )
    }
    layers, problems = layer_map(rows, modules)
    # the file entry wins over its package's; the package covers its __init__ and its other modules
    assert layers == {
        "jaxlight.errors": 0,
        "jaxlight.callbacks": 1,
        "jaxlight.callbacks.callback": 0,
        "jaxlight.callbacks.timer": 1,
        "jaxlight.engine": 1,
    }
    assert len(problems) == 3 and "`nowhere.py`" in problems[0] and "twice" in problems[1], problems
    assert problems[2].startswith("jaxlight.hooks is in no layer"), problems
    # importing the base from below its package's layer runs callbacks/__init__.py: that counts as going up
    graph = {"jaxlight.callbacks.callback": {"jaxlight.callbacks": 3}, "jaxlight.engine": {"jaxlight.errors": 1}}
    assert upward_imports(graph, layers, ["0. low", "1. high"]) == [
        "jaxlight.callbacks.callback (0. low) imports jaxlight.callbacks (1. high) at line 3"
    ]


def test_no_private_api_outside_compat():
    uses = []
    for module, path in MODULES.items():
        if module != COMPAT:
            uses += private_uses(path)
    assert not uses, (
        "private APIs of jax/jaxlib/optax/orbax/flax used outside jaxlight/compat.py (move each into compat.py "
        "with the version it was checked on and a test in tests/test_compat.py):\n" + "\n".join("  " + u for u in uses)
    )


def test_the_private_api_check_sees_what_it_must(tmp_path):
    src = tmp_path / "jaxlight" / "m.py"
    src.parent.mkdir()
    src.write_text(
        "import jax\nimport optax\nfrom jax._src import xla_bridge\nfrom orbax.checkpoint import _src\n"
        "import importlib\n"
        "x = jax._src.config\ny = fn.__closure__[0].cell_contents\nz = getattr(ckpt, '_async_manager', None)\n"
        "m = importlib.import_module('optax._src.base')\nok = jax.numpy.zeros(3)\nv = jax.__version__\n"
    )
    found = private_uses(src, tmp_path)
    lines = sorted({int(f.split(":")[1]) for f in found})
    assert lines == [3, 4, 6, 7, 8, 9], found


def test_module_sizes():
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    too_long = {m: n for m, n in sizes.items() if n > MAX_LINES}
    trainer = sizes["jaxlight.trainer"]
    assert not too_long and trainer <= MAX_TRAINER_LINES, (
        f"modules over {MAX_LINES} lines: {too_long}; jaxlight/trainer.py has {trainer} lines (at most "
        f"{MAX_TRAINER_LINES}). Issue 21 splits checkpoint.py, callbacks/model_checkpoint.py, optim.py and "
        "trainer.py on other branches: this passes only once they are merged"
    )
