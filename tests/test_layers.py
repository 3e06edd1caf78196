"""The layers' imports point down only: app -> engine -> kernels, and no module imports itself back in a circle.

Every `import` in app/, engine/ and kernels/ counts, those inside functions too (a lazy import is still a
dependency). Imports under `if TYPE_CHECKING:` (annotations only, never run) are left out of the run-time graph,
which must have no circle at all, and kept in a second graph whose circles show the parts that still reach back
into each other's types (the runner and the objects it composes): those may only shrink. `from pkg import sub`
where `sub` is a module counts as an edge to that module, not to the package. The runtime modules never import engine/tools/ (benchmarks, synthetic models,
quality tools), which the `hivejet` command and the tests use.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"kernels": 0, "engine": 1, "app": 2}

# Circles through annotations that the engine restructure has not taken apart yet: the runner with its attention,
# key preconditioning and prompt graphs, whose methods annotate the runner's batch and the batch the runner. Each must still be
# exactly a circle here; once one is gone, delete it.
KNOWN_ANNOTATION_CIRCLES = [
    {"engine.runner.runner", "engine.runner.attention", "engine.runner.batch", "engine.runner.keyprep",
     "engine.runner.prefill"},
]


def _modules() -> dict[str, Path]:
    mods = {}
    for top in LAYERS:
        for p in (ROOT / top).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _targets(mod: str, path: Path, node: ast.AST, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join(pkg + ([node.module] if node.module else []))
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
        names = subs if len(subs) == len(node.names) else [base] + subs
    out = []
    for n in names:
        while n and n not in mods:
            n = n.rpartition(".")[0]
        if n and n != mod:
            out.append(n)
    return out


def _annotation_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and getattr(n.test, "id", getattr(n.test, "attr", None)) == "TYPE_CHECKING":
            out.update(id(m) for m in ast.walk(n))
    return out


def _graph(annotations: bool = False) -> dict[str, set[str]]:
    """module -> the modules it imports (with `annotations`: TYPE_CHECKING imports too)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = set() if annotations else _annotation_only(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                edges[mod].update(_targets(mod, path, node, mods))
    return edges


def _circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_imports_point_down():
    edges = _graph(annotations=True)
    up = [f"{m} -> {t}" for m, ts in edges.items() for t in sorted(ts)
          if LAYERS[t.split(".")[0]] > LAYERS[m.split(".")[0]]]
    assert not up, "imports that point up a layer:\n" + "\n".join(up)


def test_runtime_modules_do_not_import_the_tools():
    edges = _graph()
    bad = [f"{m} -> {t}" for m, ts in edges.items() for t in sorted(ts)
           if t.startswith("engine.tools") and not m.startswith(("engine.tools", "app."))]
    assert not bad, "runtime modules importing engine/tools:\n" + "\n".join(bad)


def test_no_import_circles_at_run_time():
    circles = _circles(_graph())
    assert not circles, f"modules that import each other in a circle: {[sorted(c) for c in circles]}"


def test_no_new_circles_through_annotations():
    circles = _circles(_graph(annotations=True))
    new = [sorted(c) for c in circles if c not in KNOWN_ANNOTATION_CIRCLES]
    assert not new, f"modules that reach each other in a circle through annotations: {new}"
    gone = [sorted(c) for c in KNOWN_ANNOTATION_CIRCLES if c not in circles]
    assert not gone, f"these circles are gone: delete them from KNOWN_ANNOTATION_CIRCLES: {gone}"


def test_the_graph_sees_lazy_and_annotation_imports():
    """The checker itself: a function-level import is a run-time edge, a TYPE_CHECKING one an annotation edge."""
    run, ann = _graph(), _graph(annotations=True)
    assert "engine.runner.prefill" in run["engine.runner.runner"]             # inside a method
    assert "engine.sequence" not in run["engine.scheduler"]                   # under TYPE_CHECKING
    assert "engine.sequence" in ann["engine.scheduler"]
