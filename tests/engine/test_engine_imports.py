"""The package's boundaries, read from its source: the engine never imports Lightning (it runs on
a bare nn.Module and a process group); only engine/comm.py and the transports it chooses from
(transport.py) call torch.distributed collectives (one place counts the bytes and takes the
process group explicitly); and no module imports itself back, counting imports under
TYPE_CHECKING (two modules that know each other only for types still know each other)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

import lightning_zero3.checkpoint
import lightning_zero3.engine

ENGINE = Path(lightning_zero3.engine.__file__).parent
LIGHTNING = {"lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities"}
# Everything in torch.distributed that moves data between ranks or waits for them.
COLLECTIVES = {
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "all_gather_coalesced",
    "_all_gather_base", "all_gather_tensor", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "_reduce_scatter_base", "all_reduce", "all_reduce_coalesced", "broadcast", "broadcast_object_list", "reduce",
    "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
    "recv_object_list",
}  # fmt: skip


def _engine_files() -> list[Path]:
    files = sorted(ENGINE.glob("*.py"))
    assert {"comm.py", "hooks.py", "model.py", "unit.py"} <= {f.name for f in files}
    return files


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def collective_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every reference to a torch.distributed collective in `source`, through
    `torch.distributed.x`, an alias of torch.distributed or one of its submodules, or a name
    imported from them."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> the torch.distributed module it stands for
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch.distributed") and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full.startswith("torch.distributed") and alias.name in COLLECTIVES:
                    uses.append((node.lineno, full))
                elif full.startswith("torch.distributed"):
                    aliases[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = _dotted(node.value)
            if base is None:
                continue
            head, _, rest = base.partition(".")
            resolved = aliases.get(head, head) + (f".{rest}" if rest else "")
            if resolved.startswith("torch.distributed"):
                uses.append((node.lineno, f"{resolved}.{node.attr}"))
    return uses


def test_engine_never_imports_lightning():
    offenders = []
    for path in _engine_files():
        for line, module in _imported_modules(ast.parse(path.read_text())):
            root = module.split(".")[0]
            outside_engine = module.startswith("lightning_zero3") and not module.startswith("lightning_zero3.engine")
            if root in LIGHTNING or outside_engine:  # lightning_zero3's other modules import Lightning
                offenders.append(f"{path.name}:{line} imports {module}")
    assert offenders == []


def test_only_comm_and_its_transports_call_torch_distributed_collectives():
    uses = {path.name: collective_uses(path.read_text()) for path in _engine_files()}
    assert len(uses.pop("comm.py")) >= 3, "the checker no longer sees comm.py's own collectives"
    assert len(uses.pop("transport.py")) >= 5, "the checker no longer sees the transports' collectives"
    assert {name: found for name, found in uses.items() if found} == {}


def test_collective_checker_sees_every_spelling():
    """The checker above can fail: each of these spellings is one collective use."""
    spellings = [
        "import torch.distributed as d\nd.all_reduce(t)",
        "import torch\ntorch.distributed.broadcast(t, 0)",
        "from torch import distributed\ndistributed.barrier()",
        "from torch.distributed import all_gather_into_tensor",
        "import torch.distributed.distributed_c10d as c10d\nc10d.reduce_scatter_tensor(a, b)",
        "from torch.distributed import _functional_collectives as fc\nfc.all_reduce(t, 'sum', g)",
    ]
    for source in spellings:
        assert len(collective_uses(source)) == 1, source
    assert collective_uses("import torch.distributed as dist\ndist.get_rank(); dist.ProcessGroup") == []


PACKAGE = ENGINE.parent


def door_violations(root: Path, package: Any = lightning_zero3.engine) -> list[str]:
    """Imports under `root`, outside `package` (engine/ or checkpoint/), of one of its modules
    rather than a name of the package itself (the one door; its `__all__` is what the rest may use)."""
    offenders, folder = [], Path(package.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if folder in path.parents:
            continue
        for line, module in _imported_modules(ast.parse(path.read_text())):
            inside = module.startswith(f"{package.__name__}.")
            if inside and module.rsplit(".", 1)[-1] not in package.__all__:
                offenders.append(f"{path.relative_to(root.parent)}:{line} imports {module}")
    return offenders


@pytest.mark.parametrize("package", [lightning_zero3.engine, lightning_zero3.checkpoint], ids=["engine", "checkpoint"])
def test_code_outside_a_package_imports_only_its_door(package: Any):
    """The package, its examples and benchmarks; the tests may reach inside (they test the insides)."""
    offenders = [v for folder in ("lightning_zero3", "examples", "benchmarks") for v in door_violations(
        PACKAGE.parent / folder, package)]  # fmt: skip
    assert offenders == []


def test_the_door_check_sees_an_engine_or_checkpoint_module(tmp_path):
    """The test above can fail: importing a module of the engine, or a module from the package."""
    (tmp_path / "glue.py").write_text("from lightning_zero3.engine.comm import Comm\nimport lightning_zero3.engine."
                                      "hooks\nfrom lightning_zero3.engine import accounting, Comm\n"
                                      "from lightning_zero3.checkpoint.save import write_sharded\n")  # fmt: skip
    assert door_violations(tmp_path) == [f"{tmp_path.name}/glue.py:{n}" for n in (
        "1 imports lightning_zero3.engine.comm", "2 imports lightning_zero3.engine.hooks",
        "3 imports lightning_zero3.engine.accounting")]  # fmt: skip
    assert door_violations(tmp_path, lightning_zero3.checkpoint) == [f"{tmp_path.name}/glue.py:4 imports {m}" for m in (
        "lightning_zero3.checkpoint.save", "lightning_zero3.checkpoint.save.write_sharded")]  # fmt: skip


def test_the_checkpoint_door_exports_only_what_users_and_the_glue_use():
    """Each name of `lightning_zero3.checkpoint.__all__` is imported by the glue or is a user's (README)."""
    glue = {m.rsplit(".", 1)[-1] for path in PACKAGE.rglob("*.py") if path.parent.name != "checkpoint" for _, m in
            _imported_modules(ast.parse(path.read_text())) if m.startswith("lightning_zero3.checkpoint.")}  # fmt: skip
    readme = (PACKAGE.parent / "README.md").read_text() + (PACKAGE.parent / "docs" / "checkpoints.md").read_text()
    assert [name for name in lightning_zero3.checkpoint.__all__ if name not in glue and name not in readme] == []


# The Lightning glue's two cycles, which the other branch of issue 20 removes; then this is empty.
def import_graph(root: Path) -> dict[str, set[str]]:
    """Module (dotted, under `root`'s package) -> the package's modules it imports, wherever the
    import statement stands (under TYPE_CHECKING, inside a function). `from p import m` counts
    as importing module p.m when that is a module, else p."""
    package = root.name
    files = {".".join(path.relative_to(root.parent).with_suffix("").parts): path for path in root.rglob("*.py")}
    modules = {name.removesuffix(".__init__"): path for name, path in files.items()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]  # fmt: skip
            edges.update(t for t in targets if t.split(".")[0] == package and t in modules and t != name)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles_in_the_package_counting_type_checking_imports():
    graph = import_graph(PACKAGE)
    assert "lightning_zero3.engine.model" in graph and graph["lightning_zero3.engine.model"], graph
    cycles = [{name.removeprefix("lightning_zero3.") for name in cycle} for cycle in import_cycles(graph)]
    assert cycles == [], cycles


def test_the_cycle_finder_sees_a_type_only_import(tmp_path):
    """The test above can fail: a module that imports another only under TYPE_CHECKING, which
    imports it back, is a cycle; so is a `from package import module` of the package's own."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (package / "b.py").write_text("from pkg import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg.a import x\n")
    assert import_cycles(import_graph(package)) == [{"pkg.a", "pkg.b", "pkg.c"}]


def design_layers(text: str) -> dict[str, int]:
    """Engine file -> its layer, as the numbered list under "The engine's layers" in design.md names them."""
    section = text.split("## The engine's layers", 1)[1].split("\n## ", 1)[0]
    layers, layer = {}, 0
    for line in section.splitlines():
        match = re.match(r"(\d+)\. \*\*", line)
        layer = int(match.group(1)) if match else layer if line.startswith("   ") else 0  # an item, its lines
        for name in re.findall(r"`(\w+\.py)`", line) if layer else []:
            assert name not in layers, f"{name} stands in two layers"
            layers[name] = layer
    return layers


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Each engine import from a module to one of a lower layer (a higher number)."""
    prefix, found = "lightning_zero3.engine.", []
    for name, targets in graph.items():
        for target in (t for t in targets if name.startswith(prefix) and t.startswith(prefix)):
            low, high = name.removeprefix(prefix) + ".py", target.removeprefix(prefix) + ".py"
            if layers[high] > layers[low]:
                found.append(f"{low} (layer {layers[low]}) imports {high} (layer {layers[high]})")
    return sorted(found)


DESIGN = (PACKAGE.parent / "docs" / "design.md").read_text()


def test_every_engine_file_stands_in_one_layer_of_design_md():
    assert sorted(design_layers(DESIGN)) == sorted(f.name for f in _engine_files() if f.name != "__init__.py")


def test_no_engine_module_imports_a_layer_below_its_own():
    assert upward_imports(import_graph(PACKAGE), design_layers(DESIGN)) == []


def test_the_layer_check_sees_an_import_going_up():
    """The test above can fail: with reduce.py importing offload.py again (layer 4 -> layer 7)."""
    graph = import_graph(PACKAGE)
    graph["lightning_zero3.engine.reduce"] = graph["lightning_zero3.engine.reduce"] | {"lightning_zero3.engine.offload"}
    assert upward_imports(graph, design_layers(DESIGN)) == ["reduce.py (layer 4) imports offload.py (layer 7)"]


MODEL_MEMBERS_AT_MOST = 23  # ShardedModel methods and properties (full_numel: whole_numel's old name)
DOOR_AT_MOST = 33  # names in lightning_zero3.engine.__all__


def _public_members(cls: type) -> dict[str, Any]:
    return {name: m for name, m in vars(cls).items() if not name.startswith("_")}


def test_sharded_model_shows_four_attributes_and_documents_each_method():
    """The engine's surface (docs/design.md): collaborators private, accounting behind `stats`,
    each public member documented, and no more members than today (a ceiling: a new one replaces one)."""
    from torch import nn

    from lightning_zero3.engine.stats import ModelStats

    sharded = lightning_zero3.engine.ShardedModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device="cpu")
    assert sorted(name for name in vars(sharded) if not name.startswith("_")) == ["config", "device", "module", "stats"]
    members = _public_members(type(sharded))
    assert len(members) <= MODEL_MEMBERS_AT_MOST, sorted(members)
    assert [name for name, m in members.items() if not (m.__doc__ or "").strip()] == []
    assert [name for name, m in _public_members(ModelStats).items() if callable(m) and not m.__doc__] == []


def test_full_numel_answers_under_its_old_name_and_names_the_new_one():
    """docs/user-guide.md named `full_numel` until 2026-12; code written then still counts."""
    from torch import nn

    sharded = lightning_zero3.engine.ShardedModel(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), device="cpu")
    weight = sharded.module[0].weight
    with pytest.warns(FutureWarning, match="whole_numel"):
        assert sharded.full_numel(weight) == sharded.whole_numel(weight) == 12


def _door_users() -> dict[str, set[str]]:
    """Each name imported from `lightning_zero3.engine` by the glue, the examples or the benchmarks."""
    users: dict[str, set[str]] = {}
    for folder in ("lightning_zero3", "examples", "benchmarks"):
        for path in (PACKAGE.parent / folder).rglob("*.py"):
            if ENGINE in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "lightning_zero3.engine":
                    for alias in node.names:
                        users.setdefault(alias.name, set()).add(path.name)
    return users


def test_the_engine_door_holds_only_names_used_outside_it():
    """A ceiling on the door: every name in `__all__` is imported by the glue, an example or a
    benchmark (tests reach inside by module path), and there are no more of them than today."""
    users = _door_users()
    assert [name for name in lightning_zero3.engine.__all__ if name not in users] == []
    assert len(lightning_zero3.engine.__all__) <= DOOR_AT_MOST


def test_the_trainer_and_fabric_strategies_share_one_surface_on_their_models():
    """`sharded_model` and the gathered views: the same method in both, written once (common/base.py)."""
    from lightning_zero3 import ZeRO3FabricStrategy, ZeRO3Strategy
    from lightning_zero3.common.base import ShardedStrategy

    for name in ("sharded_model", "gathered_parameters", "gathered_for_inference"):
        assert getattr(ZeRO3Strategy, name) is getattr(ZeRO3FabricStrategy, name) is getattr(ShardedStrategy, name)


def test_the_glue_layout_holds():
    """docs/design.md, "The glue": the run imports no Lightning (the strategies hand it their plugin's
    file functions), and tools/ import neither strategy nor what only one of them uses."""
    run = [m for _, m in _imported_modules(ast.parse((PACKAGE / "common" / "run.py").read_text()))]
    one_api = {f"lightning_zero3.{name}" for name in ("strategy", "fabric_strategy", "fabric_checkpoint", "precision")}
    graph = import_graph(PACKAGE)
    tools = {name: graph[name] & one_api for name in graph if name.startswith("lightning_zero3.tools")}
    assert [m for m in run if m.split(".")[0] in LIGHTNING] == [] and {k: v for k, v in tools.items() if v} == {}
