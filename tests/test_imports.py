"""The package's import graph: layers, each importing only from the layers below it or its own, and no cycle
(the README's Development section lists the same layers, lowest first; ``ngram_pool`` is below them all)."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    {"ngram_pool", "ngram_pool.files", "ngram_pool.kernels", "ngram_pool.pool", "ngram_pool.recycle", "ngram_pool.reference",
     "ngram_pool.suffix"},
    {"lookahead.cpu", "lookahead.native", "lookahead.linear_kernels", "lookahead.layer_kernels", "lookahead.host_kernels", "lookahead.norms", "lookahead.layers", "lookahead.quants", "lookahead.kernels", "lookahead.kv", "lookahead.curve",
     "lookahead.cache_entries", "lookahead.gguf_header", "lookahead.gguf_model", "lookahead.models"},
    {"lookahead.config", "lookahead.tree", "lookahead.drafting", "lookahead.window", "lookahead.layout", "lookahead.model_forward",
     "lookahead.verify", "lookahead.rules", "lookahead.capability", "lookahead.stats", "lookahead.prompt"},
    {"lookahead.planner", "lookahead.probing", "lookahead.prior", "lookahead.lane", "lookahead.loop", "lookahead.generator"},
    {"lookahead", "lookahead.hf", "lookahead.scheduler", "lookahead.server", "lookahead.api", "lookahead.auth", "lookahead.chat", "lookahead.terminal", "lookahead.cli",
     "lookahead.vllm", "lookahead.custom_generate.generate"},
]


def modules() -> dict[str, Path]:
    found = {}
    for package in ("lookahead", "ngram_pool"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports (``from lookahead import kv`` names ``lookahead.kv``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("lookahead", "ngram_pool"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in ("lookahead", "ngram_pool"))
    return out


def test_every_module_has_a_layer_and_imports_only_downwards():
    known = modules()
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    assert set(known) == set(layer), f"modules without a layer: {set(known) - set(layer)}; gone: {set(layer) - set(known)}"
    upward = [f"{name} -> {target}" for name, path in known.items() for target in imports(path, known) - {name}
              if layer[target] > layer[name]]
    assert not upward, upward


def test_the_import_graph_has_no_cycle():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    for package in ("lookahead", "ngram_pool"):  # a package's __init__ re-exports what is below it: not a cycle
        for deps in graph.values():
            deps.discard(package)
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        raise AssertionError(f"import cycle: {e.args[1]}") from None
