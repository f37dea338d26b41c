"""The package's rooms import only downwards (docs/ARCHITECTURE.md, "Layout"), no two modules
import each other (directly or around a cycle), and the host scheduler never imports JAX.

Every import counts, also those inside functions: a lazy import up the order is still a
dependence up the order."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "deepinfer_jax"

# Rooms from the top down; a room may import the rooms of lower entries (not its siblings).
# The top-level modules (``config.py``, ``engine_config.py``, ``xla_numerics.py``, ``interrupts.py``) sit just
# above ``base``, the lowest room.
ORDER = [
    {"entrypoints"},
    {"engine"},
    {"host_scheduler", "runner", "training"},
    {"sampling", "tokenizer"},
    {"models"},
    {"checkpoint"},
    {"layers"},
    {"kernels_pallas", "kernels_ascend"},
    {"sharding"},
    {"config", "engine_config", "xla_numerics", "interrupts"},
    {"base"},
]
LEVEL = {room: i for i, rooms in enumerate(ORDER) for room in rooms}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = ("deepinfer_jax",) + f.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(path: Path, modules) -> set[str]:
    """Package modules ``path`` imports (``from pkg import mod`` names the module ``pkg.mod``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("deepinfer_jax.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deepinfer_jax"):
            if node.level:
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # the package itself (lazy public API) has none


def test_no_import_runs_up_the_room_order():
    modules = _modules()
    unknown, bad = set(), []
    for mod, path in modules.items():
        src = _room(mod)
        if src is None:
            continue
        if src not in LEVEL:
            unknown.add(src)
            continue
        for tgt in _imports(path, modules):
            dst = _room(tgt)
            if dst is None or dst == src:
                continue
            if dst not in LEVEL:
                unknown.add(dst)
            elif LEVEL[dst] <= LEVEL[src]:
                bad.append(f"{mod} imports {tgt} ({src} may not import {dst})")
    assert not unknown, f"rooms missing from ORDER (add them here and in docs/ARCHITECTURE.md): {sorted(unknown)}"
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    modules = _modules()
    graph = {m: {t for t in _imports(p, modules) if t in modules and t != m} for m, p in modules.items()}
    # a package's __init__ importing its own submodules is not a cycle we care about
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_host_scheduler_never_imports_jax():
    """Importing every host_scheduler module (and what they import) leaves JAX unloaded."""
    import subprocess
    import sys

    mods = sorted(m for m in _modules() if m.startswith("deepinfer_jax.host_scheduler"))
    code = "import sys\n" + "".join(f"import {m}\n" for m in mods) + \
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\nprint(bad)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
