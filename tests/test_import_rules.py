"""The import rules of the code base (docs/architecture.md, "Layout"), read off the code.

- Layers (import-linter's contracts in pyproject.toml): `bench` > `cli` > the processes
  (`api`, `worker`, `control`, none importing another) > `shared`; the model runner sees
  plain data (`worker/step_batch.py`), never the scheduler's live sequences.
- Only the model runner (`worker/runner/`) and the bench tools that measure it import torch.
- No import cycles between modules, lazy imports inside functions included.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "worker", "control", "shared", "cli", "bench")
TORCH_ALLOWED = (
    "worker.runner",
    "bench.roofline",
    "bench.export_hf",
    "bench.gpu_check",
    "bench.gpu_model",
    "bench.kv_transfer",
    "bench.prompt_attention",
    "bench.matmul_share",
    "bench.few_rows_stream",
    "bench.kernel_run",
    "bench.decode_sides",
    "bench.decode_attention",
    "bench.prompt_sides",
)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, include_external_packages=True)


def test_the_layers_hold():
    # In a process of its own: import-linter configures logging (disabling every logger
    # that exists), which would silence the loggers of the tests after this one.
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [lint_imports, "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_only_the_model_runner_and_its_benchmarks_import_torch(graph):
    importers = graph.find_modules_that_directly_import("torch")
    assert importers, "no module imports torch: the check would pass whatever the code did"
    outside = {m for m in importers if not any(_is_within(m, a) for a in TORCH_ALLOWED)}
    assert not outside, f"torch imported outside the model runner: {sorted(outside)}"


def test_no_module_imports_itself_through_others(graph):
    cycles = _cycles(graph, {m for m in graph.modules if m.split(".")[0] in PACKAGES})
    assert not cycles, f"import cycles: {cycles}"


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def edges(module: str) -> list[str]:
        return sorted(graph.find_modules_directly_imported_by(module) & modules)

    for start in sorted(modules):
        if start in index:
            continue
        work = [(start, iter(edges(start)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges(child))))
            elif child in on_stack:
                low[module] = min(low[module], index[child])
    return found
