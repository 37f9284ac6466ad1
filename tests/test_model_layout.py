"""qworker/model/ stays a house of rooms stacked one way: no module imports, even for type checking
or inside a function, one that imports it back, and no room imports one stacked above it."""

from __future__ import annotations

import ast
from pathlib import Path

MODEL = Path(__file__).resolve().parent.parent / "qworker" / "model"
# bottom first: a module may import modules of its own rank or below, never above
RANKS = {
    "home": 0, "dtypes": 0, "errors": 0, "arch": 0, "config": 1, "kernels": 2, "batch": 2,
    "kv_cache": 2, "layers": 3, "loading": 3, "tokenizer": 4, "decode_graph": 5, "step_choice": 5,
    "decoder": 6,
}


def _room(module: str) -> str:
    """qworker.model.kernels.linear -> kernels; qworker.model.config -> config."""
    return module.split(".")[2]


def _imports() -> dict[str, set[str]]:
    """Every qworker.model module and the qworker.model modules it imports, anywhere in it."""
    found: dict[str, set[str]] = {}
    for file in MODEL.rglob("*.py"):
        parts = file.relative_to(MODEL.parent.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qworker.model"):
                assert node.module is not None
                for alias in node.names:
                    whole = f"{node.module}.{alias.name}"
                    is_module = (MODEL.parent.parent / (whole.replace(".", "/") + ".py")).is_file()
                    deps.add(whole if is_module else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("qworker.model")}
        found[name] = {d for d in deps if d != "qworker.model"}
    return found


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (a depth-first walk), or None."""
    path: list[str] = []
    done: set[str] = set()

    def walk(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if (cycle := walk(dep)) is not None:
                return cycle
        path.pop()
        done.add(node)
        return None

    return next((c for m in sorted(graph) if (c := walk(m)) is not None), None)


def test_no_model_module_imports_one_that_imports_it_back() -> None:
    graph = _imports()
    assert len(graph) > 30, "the walk found the model's modules"
    assert _a_cycle(graph) is None, " -> ".join(_a_cycle(graph) or [])


def test_each_room_imports_only_rooms_stacked_below_it() -> None:
    graph = _imports()
    assert {_room(m) for m in graph if m.count(".") >= 2} <= set(RANKS), "a room without a rank"
    upward = [f"{m} imports {d}" for m, deps in graph.items() if m.count(".") >= 2
              for d in deps if RANKS[_room(d)] > RANKS[_room(m)]]
    assert upward == []
