"""The layers show in the imports: measuring and storing, then analysing, then acting and presenting.

No module imports a layer above its own (lazy imports inside functions count too), no import circle
exists among hyperacc's modules, and a rank that only traces never loads the analysis stack.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# the top-level part of hyperacc -> its layer; every part not named here is acting or presenting (3)
LAYER = {"": 0, "schema": 0, "records": 0, "process": 0, "options": 0, "stats": 0, "theory": 0, "store": 0, "trace": 1, "analysis": 2}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _graph() -> dict[str, set[str]]:
    """module -> the hyperacc modules it imports anywhere in its text (``from pkg import sub``: pkg.sub)."""
    mods = _modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = {f"{target}.{a.name}" for a in node.names} & mods.keys()
                deps.update(subs)
                if len(subs) < len(node.names):
                    deps.add(target)
        edges[name] = {d for d in deps if d in mods and d != name}
    return edges


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYER.get(parts[1] if len(parts) > 1 else "", 3)


def test_no_module_imports_a_layer_above_its_own() -> None:
    edges = _graph()
    assert "hyperacc.trace.tracer" in edges and "hyperacc.analysis.live_aggregate" in edges
    upward = sorted(
        f"{src} -> {dst}" for src, deps in edges.items() for dst in deps if _layer(dst) > _layer(src)
    )
    assert upward == []


def test_no_import_circle_among_hyperacc_modules() -> None:
    edges = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert circles == []


def _fresh(code: str, tmp_path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HYPERACC_TRACE"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_tracing_alone_never_loads_the_analysis_stack(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import hyperacc.trace\n"
        "tracer = hyperacc.trace.Tracer(sys.argv[1], rank=0, world_size=1, window=5, handle_sigterm=False)\n"
        "for _ in range(12):\n"
        "    with tracer.step():\n"
        "        pass\n"
        "tracer.close()\n"
        "print(tracer.aggregator is None)\n"
        "print(sorted(m for m in sys.modules if m.startswith('hyperacc.analysis')))\n"
    )
    assert _fresh(code, tmp_path).split("\n")[:2] == ["True", "[]"]


def test_live_windows_start_once_the_analysis_layer_registers_them(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from hyperacc import store\n"
        "from hyperacc.analysis import live_aggregate\n"
        "from hyperacc.trace import Tracer\n"
        "live_aggregate.install()\n"
        "tracer = Tracer(sys.argv[1], rank=0, world_size=1, window=5, handle_sigterm=False)\n"
        "for _ in range(12):\n"
        "    with tracer.step():\n"
        "        pass\n"
        "tracer.close()\n"
        "kinds = [e['kind'] for e in store.read_events(sys.argv[1]).to_pylist()]\n"
        "print(type(tracer.aggregator).__name__, kinds.count('window_gathered') > 0)\n"
    )
    assert _fresh(code, tmp_path).split("\n")[0] == "WindowAggregator True"
