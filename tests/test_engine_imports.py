"""The engine's boundaries, read from its source: it never imports Lightning (it runs on a bare
nn.Module and a process group), and only engine/comm.py calls torch.distributed collectives (one
place counts the bytes and takes the process group explicitly)."""

from __future__ import annotations

import ast
from pathlib import Path

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


def test_only_comm_calls_torch_distributed_collectives():
    uses = {path.name: collective_uses(path.read_text()) for path in _engine_files()}
    assert len(uses.pop("comm.py")) >= 4, "the checker no longer sees comm.py's own collectives"
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
