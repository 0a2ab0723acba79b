"""The package's layers, as docs/ and the README's Layout describe them: the training run
(hvdtrain/run/) written once and framework-free, modules under ~400 lines, no import circle, and
no private name imported from another module."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hvdtrain"
MAX_LINES = 400


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, ast.parse(path.read_text())


def _imports(name, tree):
    """(module imported, names taken from it) for each hvdtrain import, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hvdtrain"):
            yield node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hvdtrain"):
                    yield alias.name, []


def test_the_run_imports_no_framework():
    """hvdtrain.run loads without torch, TensorFlow or Keras (a fresh interpreter checks)."""
    code = ("import sys, hvdtrain.run.training, hvdtrain.run.elastic, hvdtrain.run.hooks; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout.strip()
    assert out == "[]"


def test_modules_are_under_400_lines():
    long = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
            for _, path, _ in _modules() if len(path.read_text().splitlines()) > MAX_LINES}
    assert long == {}


def test_no_private_name_is_imported_across_modules():
    found = [(name, module, imported) for name, _, tree in _modules()
             for module, names in _imports(name, tree) for imported in names
             if imported.startswith("_") and imported != "__version__"]
    assert found == []


def test_no_import_circle_at_module_level():
    """Module-level imports between hvdtrain modules form no cycle (imports inside functions,
    made on purpose to load a framework late, are not counted)."""
    graph = {}
    for name, _, tree in _modules():
        edges = set()
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for module, names in _imports(name, ast.Module(body=[node], type_ignores=[])):
                    edges.add(module)
                    edges.update(f"{module}.{n}" for n in names)
        graph[name] = {e for e in edges if e != name}
    known = set(graph)
    graph = {n: {e for e in edges if e in known} for n, edges in graph.items()}
    # A package's __init__ importing its own submodules is how packages expose names, not a cycle.
    def parent(a, b):
        return b.startswith(a + ".")
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph[node]:
            if parent(node, nxt) or parent(nxt, node):
                continue
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"
    for node in graph:
        if node not in state:
            visit(node, [node])
    assert cycles == []
