"""The import graph of opd/: no cycle, and no module imports from a higher layer.

LAYERS below is the one declaration of the order, lowest first; a module may import from its
own layer and the layers below. An entry names a module or a package (which covers its
submodules). Every import counts: module-level, function-local and `if TYPE_CHECKING:` ones.
A new module goes into LAYERS; an edge that cannot be helped yet goes into KNOWN_UPWARD_EDGES
with the reason, and leaves it with the change that removes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

OPD = Path(__file__).resolve().parents[1] / "opd"

LAYERS: list[list[str]] = [
    # no first-party imports, or only opd.errors; the engine registries (name -> "module:Class"
    # strings) that config validation reads
    ["opd.errors", "opd.cache", "opd.checker", "opd.sandbox_fs", "opd.packing",
     "opd.loss_parallel", "opd.divergences", "opd.rewards", "opd.sampling", "opd.teachers",
     "opd.trajectory"],
    ["opd.config", "opd.dist", "opd.tool_calls", "opd.environments", "opd.loss",
     "opd.tool_worker"],
    ["opd.tool_schemas", "opd.metrics", "opd.steps", "opd.submit", "opd.slurm_teachers", "opd.preemption",
     "opd.preflight", "opd.checkpoint", "opd.loss_sampled"],
    # the sandboxed tool executor and the recipe's plugins
    ["opd.tools", "opd.plugins"],
    ["opd.chat"],
    # conversations as token IDs
    ["opd.data"],
    # engines: student backends; the run's inputs
    ["opd.backends", "opd.inputs"],
    # the sampler and teacher seams: interfaces, the episode state machine, the engines
    ["opd.rollout", "opd.sampling.base", "opd.sampling.hf", "opd.sampling.vllm",
     "opd.sampling.vllm_engine", "opd.teachers.base", "opd.teachers.in_process",
     "opd.teachers.served", "opd.teachers.server", "opd.teachers.wire", "opd.teachers.overlap",
     "opd.teachers.output_head"],
    ["opd.eval", "opd.objective"],
    ["opd.trainer", "opd.teacher_data"],
    ["opd.pipeline"],
]

# (importer, imported): upward edges tolerated until the change that removes them lands.
KNOWN_UPWARD_EDGES: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    found = {}
    for path in OPD.rglob("*.py"):
        parts = ("opd", *path.relative_to(OPD).with_suffix("").parts)
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def import_edges(found: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported module) for every first-party import; a name imported from a
    package resolves to its submodule when it is one. Imports of a module's own package
    (`from opd.backends import x` inside opd.backends.fsdp) are not edges."""
    edges = set()
    for module, path in found.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:
                    base = ".".join(module.split(".")[:-node.level] + [node.module])
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                while name and name not in found:
                    name = name.rpartition(".")[0]
                if name and name not in (module, "opd") and not module.startswith(name + "."):
                    edges.add((module, name))
    return edges


def layer_of(module: str) -> int | None:
    """The layer of the longest LAYERS entry that is `module` or a package above it."""
    best, layer = "", None
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > len(best):
                best, layer = entry, index
    return layer


def test_every_module_has_a_layer_and_every_entry_a_module():
    found = modules()
    undeclared = sorted(module for module in found if module != "opd" and layer_of(module) is None)
    assert not undeclared, f"declare {', '.join(undeclared)} in LAYERS (tests/test_layers.py)"
    entries = [entry for layer in LAYERS for entry in layer]
    assert len(entries) == len(set(entries)), "an entry appears twice in LAYERS"
    missing = sorted(entry for entry in entries if entry not in found)
    assert not missing, f"LAYERS names {', '.join(missing)}, which opd/ does not have"


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for importer, imported in sorted(import_edges(modules())):
        low, high = layer_of(importer), layer_of(imported)
        if low is not None and high is not None and high > low:  # undeclared: the test above
            upward.append((importer, imported))
    new = [edge for edge in upward if edge not in KNOWN_UPWARD_EDGES]
    assert not new, "upward imports: " + "; ".join(
        f"{importer} (layer {layer_of(importer)}) imports {imported} (layer "
        f"{layer_of(imported)})" for importer, imported in new)
    gone = sorted(KNOWN_UPWARD_EDGES - set(upward))
    assert not gone, f"no longer imported, remove from KNOWN_UPWARD_EDGES: {gone}"


def test_no_import_cycle():
    edges = import_edges(modules()) - KNOWN_UPWARD_EDGES
    after: dict[str, set[str]] = {}
    for importer, imported in edges:
        after.setdefault(importer, set()).add(imported)
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(after.get(module, ())):
            if state.get(imported) == "open":
                cycle = path[path.index(imported):] + [module, imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported, path + [module])
        state[module] = "done"

    for module in sorted(after):
        if module not in state:
            visit(module, [])
