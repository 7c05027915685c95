"""No two modules of agentrl import each other, directly or round a longer loop, at module top
level or inside functions: a function-level import hides a cycle from Python, not from the
reader (train imported the trainer actor's module, which imported train back). The graph
holds every folder that installs into agentrl (agentrl/, envs/, tools/, sandboxes/,
trainers/), and a package's __init__ counts as a module (a package that imports its
submodule, which imports the package back, is a cycle). Read from the source with ast;
nothing is imported."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# setup.py's map: these folders install as subpackages of agentrl
FOLDERS = {"agentrl": "agentrl", "agentrl.envs": "envs", "agentrl.tools": "tools",
           "agentrl.sandboxes": "sandboxes", "agentrl.trainers": "trainers"}


def module_files() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def imported_modules(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """Modules of the package that `name` imports anywhere in its file -> the first line."""
    is_package = path.name == "__init__.py"
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import fn` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:  # agentrl.x.y.Class -> agentrl.x.y
                target = target.rpartition(".")[0]
            if target and target != name:
                out.setdefault(target, node.lineno)
    return out


def import_graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}, files


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a list."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def describe(component: list[str], graph, files) -> str:
    members = set(component)
    edges = [f"  {files[a].relative_to(ROOT)}:{line} imports {b}"
             for a in component for b, line in sorted(graph[a].items()) if b in members]
    return "import cycle among " + ", ".join(component) + ":\n" + "\n".join(edges)


def test_no_import_cycle():
    graph, files = import_graph()
    found = cycles(graph)
    assert not found, "\n\n".join(describe(c, graph, files) for c in found)


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: a cycle closed by an import inside a function is found."""
    (tmp_path / "a.py").write_text("import pkg.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    known = {"pkg.a", "pkg.b"}
    graph = {"pkg.a": imported_modules("pkg.a", tmp_path / "a.py", known),
             "pkg.b": imported_modules("pkg.b", tmp_path / "b.py", known)}
    assert graph == {"pkg.a": {"pkg.b": 1}, "pkg.b": {"pkg.a": 2}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    graph["pkg.b"] = {}
    assert cycles(graph) == []


def test_the_check_sees_a_package_and_its_submodule_importing_each_other(tmp_path):
    """`from . import name` in a submodule imports the package's __init__, which imports it."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from .pool import Pool\n")
    (tmp_path / "pkg" / "pool.py").write_text("class Pool:\n    def new(self):\n        from . import create\n")
    known = {"pkg", "pkg.pool"}
    graph = {"pkg": imported_modules("pkg", tmp_path / "pkg" / "__init__.py", known),
             "pkg.pool": imported_modules("pkg.pool", tmp_path / "pkg" / "pool.py", known)}
    assert cycles(graph) == [["pkg", "pkg.pool"]]
    files = {"pkg": ROOT / "pkg" / "__init__.py", "pkg.pool": ROOT / "pkg" / "pool.py"}
    assert describe(["pkg", "pkg.pool"], graph, files) == ("import cycle among pkg, pkg.pool:\n"
                                                           "  pkg/__init__.py:1 imports pkg.pool\n"
                                                           "  pkg/pool.py:3 imports pkg")


def test_the_graph_covers_the_package():
    graph, _ = import_graph()
    for module in ("agentrl.train", "agentrl.trainers.torch_trainer", "agentrl.envs.target_token",
                   "agentrl.tools.client", "agentrl.sandboxes.pool", "agentrl.http", "agentrl.cluster",
                   "agentrl.cluster.placement", "agentrl.cluster.engine_actor", "agentrl.cluster.trainer_actor"):
        assert module in graph, module
    assert "agentrl.cluster.trainer_actor" in graph["agentrl.train"]
    # a function-level import counts: the trainer actor builds its weight sync inside __init__
    assert "agentrl.weight_sync" in graph["agentrl.cluster.trainer_actor"]


def reachable(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_weight_transfer_sits_below_the_trainers_sync():
    """agentrl.weight_transfer (buckets, CUDA IPC, NCCL, disk: how weights travel) needs nothing of the
    trainer's side (agentrl.weight_sync), the trainers or the cluster's actors; the trainers export
    through it without importing the trainer's sync."""
    graph, _ = import_graph()
    below = reachable(graph, "agentrl.weight_transfer")
    assert not {m for m in below if m == "agentrl.weight_sync" or m.startswith(("agentrl.trainers", "agentrl.cluster"))}
    assert "agentrl.weight_transfer" in graph["agentrl.weight_sync"]
    assert "agentrl.weight_transfer" in graph["agentrl.trainers.megatron.weights"]
    assert "agentrl.weight_sync" not in reachable(graph, "agentrl.trainers.megatron.trainer")
