"""Pick units from a module tree and assign every parameter to exactly one unit. The root is
always one; a parameter reached from several units (tied weights, a shared module) belongs to
their lowest common ancestor, so it is gathered once and whole wherever it is used.

[Note: nn.Module's registries]
The engine reads modules' own `_parameters`, `_buffers` and `_modules` and writes `_parameters`
directly, as FSDP2 does: `named_parameters()` yields a parameter registered under two names once
(the plan needs every name to keep ties), and `register_parameter` runs the global registration
hooks (materialize.py's meta hook). Likewise `Tensor._version`, autograd's in-place counter.
Private, tried on torch 2.13.0; no fallback: a change would fail the first setup loudly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

from torch import nn

WrapPolicy = Union[None, set[type[nn.Module]], Callable[[nn.Module], bool]]  # noqa: UP007 - runtime alias


@dataclass(eq=False)
class ParamEntry:
    param: nn.Parameter
    owners: list[tuple[nn.Module, str]]
    names: list[str]


@dataclass(eq=False)
class UnitPlan:
    module: nn.Module
    name: str
    parent: UnitPlan | None
    params: list[ParamEntry] = field(default_factory=list)

    def ancestors(self) -> list[UnitPlan]:
        """This unit and its enclosing units, innermost first."""
        chain: list[UnitPlan] = []
        node: UnitPlan | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        return chain


@dataclass
class Plan:
    units: list[UnitPlan]  # root first, then in module traversal order
    persistent: list[ParamEntry]  # small parameters kept whole on every rank


def validate_wrap_policy(policy: object) -> WrapPolicy:
    # A module instance is callable too, but calling it runs its forward: not a policy.
    if policy is None or callable(policy) and not isinstance(policy, (type, nn.Module)):
        return policy  # type: ignore[return-value]
    if isinstance(policy, (set, frozenset, list, tuple)) and all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in policy
    ):
        return set(policy)
    raise ValueError(
        f"wrap_policy must be None (automatic), a set of nn.Module classes, or a callable "
        f"(module) -> bool; got {policy!r}. Example: wrap_policy={{MyTransformerBlock}}."
    )


def _automatic_units(root: nn.Module) -> set[nn.Module]:
    """Each child of an nn.ModuleList/nn.Sequential whose class repeats among its siblings and
    which holds parameters: transformer blocks, ResNet stages, MLP layers."""
    chosen: set[nn.Module] = set()
    for module in root.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        for child in children:
            repeats = sum(type(other) is type(child) for other in children) >= 2
            if repeats and any(True for _ in child.parameters()):
                chosen.add(child)
    return chosen


def _unit_modules(root: nn.Module, policy: WrapPolicy) -> set[nn.Module]:
    if policy is None:
        return _automatic_units(root)
    if isinstance(policy, set):
        match = tuple(policy)
        return {m for m in root.modules() if m is not root and isinstance(m, match)}
    return {m for m in root.modules() if m is not root and policy(m)}


def _common_ancestor(units: list[UnitPlan]) -> UnitPlan:
    common = units[0].ancestors()
    for unit in units[1:]:
        chain = set(map(id, unit.ancestors()))
        common = [u for u in common if id(u) in chain]
    return common[0]


def make_plan(
    root: nn.Module, policy: WrapPolicy = None, persistence_threshold: int = 0, shard_group_size: int = 1
) -> Plan:
    """Choose units and assign parameters; every rank builds the same plan. A parameter of at
    most `shard_group_size` elements stays whole whatever `persistence_threshold` says: its
    one-element shard would broadcast against any shape, so code reading it outside its unit
    would compute silently wrong numbers on the ranks holding padding.
    """
    unit_modules = _unit_modules(root, policy)
    root_unit = UnitPlan(module=root, name="<root>", parent=None)
    units: list[UnitPlan] = [root_unit]
    unit_of_module: dict[int, UnitPlan] = {id(root): root_unit}

    # Walk every path (a shared module under each parent), noting each occurrence's innermost unit.
    param_units: dict[int, list[UnitPlan]] = {}
    entries: dict[int, ParamEntry] = {}

    def visit(module: nn.Module, prefix: str, enclosing: UnitPlan) -> None:
        if module is not root and module in unit_modules:
            unit = unit_of_module.get(id(module))
            if unit is None:
                unit = UnitPlan(module=module, name=prefix, parent=enclosing)
                unit_of_module[id(module)] = unit
                units.append(unit)
            enclosing = unit
        for attr, param in module._parameters.items():
            if param is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            entry = entries.get(id(param))
            if entry is None:
                entry = entries[id(param)] = ParamEntry(param=param, owners=[], names=[])
                param_units[id(param)] = []
            entry.owners.append((module, attr))
            entry.names.append(name)
            param_units[id(param)].append(enclosing)
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}.{child_name}" if prefix else child_name, enclosing)

    visit(root, "", root_unit)

    persistent: list[ParamEntry] = []
    for key, entry in entries.items():
        # Each owner once (modules hash by identity), but every name: `state_dict()` lists the
        # tensor under each path.
        entry.owners, entry.names = list(dict.fromkeys(entry.owners)), list(dict.fromkeys(entry.names))
        if entry.param.numel() <= max(persistence_threshold, shard_group_size):
            persistent.append(entry)
        else:
            _common_ancestor(param_units[key]).params.append(entry)
    return Plan(units=units, persistent=persistent)
