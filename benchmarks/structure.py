"""Structure figures of a checkout (issue 30's before/after): Trainer attributes read outside trainer.py, and
the modules engine.py needs at run time with those from layers above it.

- ``trainer.<attr>`` reads: AST attribute reads on ``trainer``, ``self.trainer`` and ``self._trainer`` in
  ``jaxlight/`` outside ``jaxlight/trainer.py`` (reads, distinct (attr, file) pairs, distinct names; the
  same for ``jaxlight/callbacks/`` alone).
- engine.py's needs: the transitive run-time import graph of ``tests/test_architecture.py`` (imports inside
  functions count, ``TYPE_CHECKING`` blocks do not), and its layer table in docs/ARCHITECTURE.md where the
  checkout has one.

    python benchmarks/structure.py [CHECKOUT]      # default: this checkout
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import sys


def trainer_reads(root: pathlib.Path, sub: str = "") -> tuple[int, int, int]:
    reads, pairs, names = 0, set(), set()
    for p in sorted((root / "jaxlight" / sub).rglob("*.py")):
        if p == root / "jaxlight" / "trainer.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute):
                v = node.value
                on_trainer = isinstance(v, ast.Name) and v.id == "trainer"
                if on_trainer or (isinstance(v, ast.Attribute) and v.attr in ("trainer", "_trainer")):
                    reads += 1
                    pairs.add((node.attr, p))
                    names.add(node.attr)
    return reads, len(pairs), len(names)


def engine_needs(root: pathlib.Path) -> str:
    sys.path.insert(0, str(root))
    arch = importlib.import_module("tests.test_architecture")
    graph = arch.import_graph()
    seen, todo = set(), ["jaxlight.engine"]
    while todo:
        for dep in graph.get(todo.pop(), {}):
            if dep.startswith("jaxlight") and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    if not hasattr(arch, "layer_table"):
        return f"engine.py needs {len(seen)} modules (no layer table in this checkout)"
    layers, _ = arch.layer_map(arch.layer_table((root / "docs" / "ARCHITECTURE.md").read_text()), arch._modules())
    above = sorted(d for d in seen if layers.get(d, -1) > layers["jaxlight.engine"])
    return f"engine.py needs {len(seen)} modules; {len(above)} from layers above it {above}"


if __name__ == "__main__":
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    for label, sub in (("jaxlight/", ""), ("jaxlight/callbacks/", "callbacks")):
        reads, pairs, names = trainer_reads(root, sub)
        print(f"trainer reads in {label}: {reads} reads, {pairs} (attr, file) pairs, {names} distinct names")
    print(engine_needs(root))
