"""The package's layers, enforced: a test walks every import of src/shardwise.

Layers, lowest first (docs/architecture.md): errors -> layout ->
tensor -> ops, comm -> interop -> checkpoint -> testing -> cli -> the package
itself. A module may import its own layer and the layers below, never above
and never a sibling layer; imports inside functions count as much as those at
the top (an import moved into a function still is a dependency), only
`if TYPE_CHECKING:` blocks are left out (they never run). Nothing imports test
or benchmark code, the import graph has no cycle, and only the layers that
move bytes between processes import torch.distributed's process-group API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "shardwise"

# unit -> layer; units on one layer may not import each other.
LAYERS: dict[str, float] = {
    "shardwise.errors": 0,
    "shardwise.layout": 1,
    "shardwise.storage": 1,
    "shardwise.tensor": 2,
    "shardwise.comm": 3,
    "shardwise.ops": 3.5,  # op rules move data: they call comm's transfers
    "shardwise.interop": 4,
    "shardwise.checkpoint": 5,  # the package itself (`swc`): the public names, above its parts
    # checkpoint's parts, lowest first: the format on disk, moving its bytes, the
    # engine, the DCP plugins over it, one-process tools, client adapters, the API
    "shardwise.checkpoint.format": 4.1,
    "shardwise.checkpoint.io": 4.2,
    "shardwise.checkpoint.engine": 4.3,
    "shardwise.checkpoint.dcp": 4.4,
    "shardwise.checkpoint.offline": 4.5,
    "shardwise.checkpoint.clients": 4.6,
    "shardwise.checkpoint.api": 4.7,
    "shardwise.testing": 6,
    "shardwise.cli": 7,
    "shardwise": 8,
    "shardwise.legacy": 8,  # a facade over shardwise.interop.legacy, beside the package
    "shardwise.__main__": 9,
}

# Modules that may import torch.distributed beyond the DCP metadata types.
PROCESS_GROUP_UNITS = {"shardwise.comm", "shardwise.ops", "shardwise.interop"} | {
    u for u in LAYERS if u == "shardwise.checkpoint" or u.startswith("shardwise.checkpoint.")
}
# What any layer may import from torch.distributed: plain data types, no process group.
TYPES_ONLY = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
)
TYPES_ONLY_MODULES = {"shardwise.tensor.dcp_hooks"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _unit(module: str) -> str:
    best = max((u for u in LAYERS if module == u or module.startswith(u + ".")), key=len)
    return best


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(module: str) -> list[tuple[str, int]]:
    path = MODULES[module]
    return _imports_in(path.read_text(), module, path.name == "__init__.py")


def _imports_in(source: str, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(imported module, line) for every import that runs, resolved to full names."""
    tree = ast.parse(source)
    skipped = _type_checking_lines(tree)
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
            # `from . import x` imports the submodule x
            found += [
                (f"{name}.{a.name}", node.lineno)
                for a in node.names
                if f"{name}.{a.name}" in MODULES
            ]
    return found


def _edges(module: str) -> set[str]:
    """The shardwise modules importing `module` runs (a submodule runs its packages)."""
    own_packages = {module.rsplit(".", i)[0] for i in range(module.count(".") + 1)}
    out = set()
    for name, _ in _imports(module):
        if not (name == "shardwise" or name.startswith("shardwise.")):
            continue
        while name not in MODULES:  # `from pkg.mod import name` of a non-module name
            name = name.rpartition(".")[0]
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            target = ".".join(parts[:i])
            if target not in own_packages and target in MODULES:
                out.add(target)
    return out


def test_every_module_is_in_a_layer() -> None:
    assert "shardwise.tensor.sharded" in MODULES and "shardwise.comm.transfer" in MODULES
    assert [m for m in MODULES if _unit(m) == "shardwise" and m != "shardwise"] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_or_sideways_import(module: str) -> None:
    unit = _unit(module)
    wrong = [
        f"{module} imports {target} ({_unit(target)}, layer {LAYERS[_unit(target)]}) "
        f"from layer {LAYERS[unit]}"
        for target in sorted(_edges(module))
        if _unit(target) != unit and LAYERS[_unit(target)] >= LAYERS[unit]
    ]
    assert wrong == []


def test_no_import_cycles() -> None:
    graph = {m: _edges(m) for m in MODULES}
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif state[nxt] == 0:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_process_groups_only_where_bytes_move(module: str) -> None:
    torch_distributed = [
        (name, line)
        for name, line in _imports(module)
        if name == "torch.distributed" or name.startswith("torch.distributed.")
    ]
    if _unit(module) in PROCESS_GROUP_UNITS or _unit(module) in (
        "shardwise.testing",
        "shardwise.cli",
    ):
        return
    allowed = TYPES_ONLY if module in TYPES_ONLY_MODULES else ()
    assert [(n, line) for n, line in torch_distributed if n not in allowed] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_test_or_benchmark_code_in_the_package(module: str) -> None:
    names = [n for n, _ in _imports(module)]
    assert [n for n in names if n.split(".")[0] in ("tests", "benchmarks", "conftest")] == []


def test_the_walker_sees_what_it_must() -> None:
    # The checks above are only as good as the walker: it must see relative,
    # nested and function-level imports, and skip TYPE_CHECKING blocks.
    assert "shardwise.tensor.provided" in _edges("shardwise.comm")
    assert "shardwise.tensor" in _edges("shardwise.comm.build")
    assert "shardwise.tensor" not in _edges("shardwise.comm.agreement")
    assert "shardwise.tensor.sharded" not in _edges("shardwise.tensor.dcp_hooks")
    source = """
from __future__ import annotations
from typing import TYPE_CHECKING
import torch.distributed as dist
from ..layout import Block
from . import sharded
if TYPE_CHECKING:
    from ..comm import gather
def f():
    from ..checkpoint.engine import save
"""
    found = _imports_in(source, "shardwise.tensor.x", is_package=False)
    assert found == [
        ("__future__", 2),
        ("typing", 3),
        ("torch.distributed", 4),
        ("shardwise.layout", 5),
        ("shardwise.tensor", 6),
        ("shardwise.tensor.sharded", 6),
        ("shardwise.checkpoint.engine", 10),
        ("shardwise.checkpoint.engine.save", 10),  # a submodule of that name, imported too
    ]


# Sub-packages with a face: their `__init__` exports what other parts use.
FACED = ("format", "io", "engine", "clients", "offline")


def _face_of(module: str) -> str | None:
    """The faced checkpoint sub-package `module` lies in, if any."""
    parts = module.split(".")
    if parts[:2] == ["shardwise", "checkpoint"] and len(parts) > 2 and parts[2] in FACED:
        return ".".join(parts[:3])
    return None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_into_a_checkpoint_sub_package_go_through_its_face(module: str) -> None:
    """A module outside a faced sub-package imports only the sub-package itself
    (`from ..format import Manifest`), never one of its modules
    (`from ..format.manifest import Manifest`): the face is the sub-package's surface."""
    own = _face_of(module)
    wrong = [
        f"{module}:{line} imports {name}; import it from {_face_of(name)}"
        for name, line in _imports(module)
        if _face_of(name) not in (None, own)
        and name != _face_of(name)
        and name.rpartition(".")[2] not in _exported(_face_of(name))  # `from ..io import commit`
    ]
    assert wrong == []


def _exported(face: str | None) -> set[str]:
    """The names a face's `__init__` lists in `__all__` (a name there is the face's
    attribute, even where a module of that name exists: `io.commit`)."""
    tree = ast.parse(MODULES[face].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    return set()


def test_the_face_check_sees_a_sibling_module_import() -> None:
    found = _imports_in(
        "from ..format.table import ChunkTable\nfrom ..io import Lease\n",
        "shardwise.checkpoint.engine.x",
        is_package=False,
    )
    assert [n for n, _ in found if _face_of(n) != n] == ["shardwise.checkpoint.format.table"]
