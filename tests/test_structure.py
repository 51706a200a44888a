"""The code's shape: no import cycles between the project's modules (imports inside functions
count too: they hold a cycle together just the same), and every module opens with a docstring."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fp4moe_ops", "hf_integration")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules that module ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            candidates = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for c in candidates:
            while c and c not in known:  # "pkg.mod.func" -> "pkg.mod"
                c = c.rpartition(".")[0]
            if c and c != name:
                targets.add(c)
    return targets


def test_no_import_cycles_between_project_modules():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    # A package's __init__ imports its own modules to re-export them; a module importing its
    # package's public names (``from fp4moe_ops import X``) is fine as long as the module itself is
    # not among what that __init__ pulls in. Cycles are searched on module-to-module edges: an edge
    # to a package __init__ stands for the modules that __init__ imports.
    def expand(target: str, seen=()) -> set[str]:
        if target in PACKAGES or target.endswith(".backends") or target.endswith(".triton_moe"):
            if mods[target].name == "__init__.py" and target not in seen:
                return {t for d in graph[target] for t in expand(d, (*seen, target))}
        return {target}

    edges = {name: {t for d in deps for t in expand(d)} - {name} for name, deps in graph.items()
             if mods[name].name != "__init__.py"}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_module_opens_with_a_docstring(name):
    doc = ast.get_docstring(ast.parse(modules()[name].read_text()))
    assert doc and len(doc.split()) >= 8, f"{name}: its opening docstring should say what the module owns"
