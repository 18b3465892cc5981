"""Optimizers that need whole matrices (torch.optim.Muon), stepped exactly on 1-D shards.

[Note: whole-matrix steps]
Such an optimizer declares a `WholeMatrixNeed`: per parameter, its step is element-wise (`before`,
`after`) around one transform that needs the whole matrix (`whole`). (docs/design.md, whole-matrix
steps)

The user's optimizer object is the one stepped: a step pre-hook (public `register_step_pre_hook`)
runs the sharded step, after the closure when one is passed (backward runs inside it), and
hides the shards' gradients, so the optimizer's own step updates only its whole parameters
(those at or below `persistence_threshold`); a post-hook gives the gradients back. Nothing in
torch is patched. Another optimizer of this kind (a Shampoo-style preconditioner) is one more
`WholeMatrixNeed` in `WHOLE_MATRIX_NEEDS`.

[Note: optimizers built on whole shapes]
`torch.optim.Muon(params)` refuses a parameter that is not 2-D, so it cannot be built on shards.
(docs/design.md, optimizers built on whole shapes)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_zero3.engine.comm import Comm
from lightning_zero3.engine.shard import ShardedParam, shard_slice

Group = dict[str, Any]  # one param group of the optimizer


@dataclass(frozen=True)
class WholeMatrixNeed:
    """How an optimizer's step splits into element-wise parts and one whole-matrix transform."""

    before: Callable[[Tensor, Group, dict[str, Any]], Tensor]  # (grad piece, group, state) -> piece to transform
    whole: Callable[[Tensor, Group], Tensor]  # (whole matrix, group) -> transformed matrix, on its owner
    after: Callable[[Tensor, Tensor, Group, torch.Size], None]  # (param piece, its result, group, whole shape)
    missing: Callable[[], str | None]  # why this torch cannot run it, or None


# ---- torch.optim.Muon -------------------------------------------------------------------------
# [Note: Muon's pieces]
# torch.optim.Muon, per parameter: momentum and Nesterov lerps (element-wise), Newton-Schulz
# orthogonalisation (whole), decoupled weight decay and the update scaled by `_adjust_lr` of the
# whole shape (element-wise). Its `_zeropower_via_newtonschulz` and `_adjust_lr` (torch/optim/
# _muon.py) are private: called so that the update is torch's own (tried on torch 2.13). A torch
# without them gets Muon refused at setup on every rank (`missing`), naming this.
def _muon_before(grad: Tensor, group: Group, state: dict[str, Any]) -> Tensor:
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - group["momentum"])
    return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf


def _muon_whole(matrix: Tensor, group: Group) -> Tensor:
    orthogonalise = torch.optim._muon._zeropower_via_newtonschulz  # private: Note: Muon's pieces
    return orthogonalise(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])


def _muon_after(param: Tensor, update: Tensor, group: Group, whole_shape: torch.Size) -> None:
    lr = float(group["lr"])  # a 1-element tensor too, as torch's `_to_scalar`
    adjusted = torch.optim._muon._adjust_lr(lr, group["adjust_lr_fn"], whole_shape)  # private: Note: Muon's pieces
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(update, alpha=-adjusted)


def _muon_missing() -> str | None:
    found = [hasattr(torch.optim._muon, name) for name in ("_zeropower_via_newtonschulz", "_adjust_lr")]
    return None if all(found) else f"this torch ({torch.__version__}) computes Muon's update in functions unknown here"


MUON = WholeMatrixNeed(before=_muon_before, whole=_muon_whole, after=_muon_after, missing=_muon_missing)
# Matched by exact class: a subclass may step differently (optim.py refuses it by name).
WHOLE_MATRIX_NEEDS: dict[type[torch.optim.Optimizer], WholeMatrixNeed] = {torch.optim.Muon: MUON}


def whole_matrix_need(optimizer: torch.optim.Optimizer) -> WholeMatrixNeed | None:
    """What `optimizer` declares it needs whole, or None for an element-wise one."""
    return WHOLE_MATRIX_NEEDS.get(type(optimizer))


# ---- the sharded step -------------------------------------------------------------------------
class _Sharded(Protocol):  # what of ShardedModel (model.py, which imports this module) is used
    def sharded_param(self, param: Tensor) -> ShardedParam | None: ...

    @property
    def shard_comms(self) -> tuple[Comm, Comm | None]: ...


def balanced_owners(numels: list[int], ranks: int) -> list[int]:
    """The owner rank of each matrix: largest first, to the least loaded rank (lowest on ties)."""
    load, owners = [0] * ranks, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += numels[i]
    return owners


class WholeMatrixSteps:
    """Steps `optimizer`'s sharded parameters on whole matrices (Note: whole-matrix steps)."""

    def __init__(self, optimizer: torch.optim.Optimizer, need: WholeMatrixNeed, model: _Sharded) -> None:
        self.optimizer = optimizer
        self.need = need
        self._model = model
        self._comm = model.shard_comms[0]  # with shard_size, each shard group steps its own replica alike
        self._hidden: list[tuple[Tensor, Tensor]] = []  # (parameter, gradient) hidden from the optimizer's step
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)

    def _before_step(self, optimizer: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        # `args` holds the optimizer first (torch's step wrapper), then the closure if positional.
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is None:
            self.step_shards()
            return None

        def closure_then_shards() -> Any:
            loss = closure()
            self.step_shards()
            return loss

        if len(args) > 1:
            return (args[0], closure_then_shards, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_shards}

    def _after_step(self, optimizer: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        for param, grad in self._hidden:
            param.grad = grad
        self._hidden.clear()

    def _pieces(self) -> list[tuple[Group, Tensor, ShardedParam]]:
        return [
            (group, p, sharded)
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and (sharded := self._model.sharded_param(p)) is not None
        ]

    @torch.no_grad()
    def step_shards(self) -> None:
        """The sharded parameters' step, collective over the shard group; hides their gradients."""
        pieces = self._pieces()
        if not pieces:
            return
        comm, need = self._comm, self.need
        n, device = comm.world_size, comm.device or pieces[0][1].device
        owners = balanced_owners([sharded.numel for *_, sharded in pieces], n)
        to_send = [need.before(p.grad, group, self.optimizer.state[p]) for group, p, _ in pieces]  # type: ignore[arg-type]
        order = sorted(range(len(pieces)), key=lambda i: owners[i])  # by owner, stable
        sizes = [sharded.shard_numel for *_, sharded in pieces]
        splits = [sum(sizes[i] for i in order if owners[i] == r) for r in range(n)]
        sent = torch.cat([to_send[i].reshape(-1).to(device) for i in order])  # dtypes promoted: lossless
        mine, own = [i for i in order if owners[i] == comm.rank], splits[comm.rank]
        rows = sent.new_empty(n * own)
        comm.all_to_all(rows, sent, output_splits=[own] * n, input_splits=splits, what="whole matrices' pieces")
        results, offset = [], 0
        for i in mine:  # rows: (n, own), rank q's pieces of my matrices side by side in row q
            group, _, sharded = pieces[i]
            matrix = rows.view(n, own)[:, offset : offset + sizes[i]].reshape(-1)[: sharded.numel]
            result = need.whole(matrix.view(sharded.whole_shape), group).reshape(-1)
            padded = sent.new_zeros(n * sizes[i])
            padded[: sharded.numel] = result  # in the pieces' dtype, wider than the result's or equal
            results.append(padded.view(n, sizes[i]))
            offset += sizes[i]
        back = torch.cat(results, dim=1).reshape(-1) if results else sent.new_empty(0)
        returned = torch.empty_like(sent)
        comm.all_to_all(
            returned,
            back,
            output_splits=splits,
            input_splits=[own] * n,
            what="whole matrices' results",
            payload_is_output=True,
        )
        offset = 0
        for i in order:
            group, p, sharded = pieces[i]
            need.after(p, returned[offset : offset + sizes[i]].to(p.device), group, sharded.whole_shape)
            offset += sizes[i]
        for _, p, _ in pieces:
            self._hidden.append((p, p.grad))  # type: ignore[arg-type]
            p.grad = None


def step_whole_matrices(model: _Sharded, optimizer: torch.optim.Optimizer, owner: str) -> WholeMatrixSteps | None:
    """Make `optimizer` step its shards on whole matrices if it declares that need (None if not).
    Call once per optimizer, on every rank, after it holds the shards."""
    need = whole_matrix_need(optimizer)
    if need is None:
        return None
    why = need.missing()
    if why is not None:
        raise ValueError(
            f"{owner} cannot train with {type(optimizer).__name__}: {why} (lightning_zero3/engine/whole_matrix.py, "
            f"Note: Muon's pieces). Use the torch versions this package was tried with (2.13), or DDP."
        )
    return WholeMatrixSteps(optimizer, need, model)


def whole_matrix_step_bytes(
    sharded_param: Callable[[Tensor], ShardedParam | None], optimizers: Iterable[torch.optim.Optimizer]
) -> int:
    """Payload bytes of the two All-to-Alls per step of `optimizers` that need whole matrices:
    twice each trainable sharded parameter's piece, in the pieces' promoted dtype."""
    total = 0
    for optimizer in optimizers:
        if whole_matrix_need(optimizer) is None:
            continue
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        shards = [(p, s) for p in params if (s := sharded_param(p)) is not None]
        if shards:
            dtype = functools.reduce(torch.promote_types, [p.dtype for p, _ in shards])
            total += 2 * sum(s.shard_numel for _, s in shards) * dtype.itemsize
    return total


@contextmanager
def whole_shapes(sharded_params: Iterable[ShardedParam]) -> Iterator[None]:
    """Each sharded parameter shows its whole shape inside, its values NaN; a write is refused on
    exit, the shards untouched (Note: optimizers built on whole shapes)."""
    shown: list[tuple[ShardedParam, Tensor, Tensor]] = []
    try:
        for sharded in sharded_params:
            shard = sharded.param.data
            if shard.numel() == 0:  # nothing to view; no optimizer steps it
                continue
            stand_in = torch.full((1,), float("nan"), dtype=shard.dtype, device=shard.device)
            shown.append((sharded, shard, stand_in))
            sharded.param.data = stand_in.as_strided(sharded.whole_shape, [0] * len(sharded.whole_shape))
        yield
    finally:
        for sharded, shard, _ in shown:
            sharded.param.data = shard
    untouched = torch.cat([stand_in for *_, stand_in in shown]).isnan().tolist() if shown else []  # one sync
    if written := [sharded.name for (sharded, *_), nan in zip(shown, untouched) if not nan]:
        raise RuntimeError(
            f"{written[:5]} were written while the optimizers were built (e.g. an init in configure_optimizers). "
            f"There a sharded parameter shows its whole shape but holds no values, so the write was dropped. "
            f"Initialise weights in the module's __init__ or configure_model(), or after setup under "
            f"gathered_parameters(modifier_rank=0)."
        )


def shard_state_built_whole(model: _Sharded, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """State the optimizers' constructors made inside `whole_shapes` in a parameter's whole shape:
    this rank's piece of it instead (Note: optimizers built on whole shapes)."""
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            if (sharded := model.sharded_param(param)) is None:
                continue
            for key, value in state.items():
                if isinstance(value, Tensor) and value.dim() and value.shape == sharded.whole_shape:
                    state[key] = shard_slice(value, sharded.rank, sharded.world_size)


__all__ = [
    "MUON",
    "WHOLE_MATRIX_NEEDS",
    "WholeMatrixNeed",
    "WholeMatrixSteps",
    "balanced_owners",
    "whole_shapes",
    "shard_state_built_whole",
    "step_whole_matrices",
    "whole_matrix_need",
    "whole_matrix_step_bytes",
]
