"""Bytes per training step for each dtype policy, measured on 2 CPU ranks (gloo).

    python examples/measure_precision.py                 # the example's small GPT, ~20-40 s
    python examples/measure_precision.py --size tiny     # the tiny one

Builds the GPT of `examples/train_gpt.py` on each rank, shards it with the engine
(`ShardedModel`, what `ZeRO3Strategy` runs under the Trainer), trains 3 AdamW steps on random
tokens under each policy and prints, for the last step: the dtypes of the shards (the optimizer's
master copy), of the gathered parameters and of the shard gradients; the payload bytes of the
All-Gathers and Reduce-Scatters next to `expected_step_bytes()` (the formula of
docs/accounting.md); and this rank's model-state bytes. Each row says which Trainer precision
flag and strategy options give that policy.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests.support.ranks

from train_gpt import GPT, SIZES, CharTokenizer, GPTConfig, load_text  # noqa: E402

from lightning_zero3.engine import ShardedModel  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (what gives it under the Trainer, module dtype, param_dtype, reduce_dtype, autocast dtype)
POLICIES = [
    ('"32-true"', FP32, None, None, None),
    ('"bf16-mixed"', FP32, BF16, None, BF16),
    ('"bf16-mixed", reduce_dtype="bf16"', FP32, BF16, BF16, BF16),
    ('"16-mixed" (on a GPU)', FP32, FP16, None, FP16),
    ('"bf16-true"', BF16, None, None, None),
    ('"bf16-true", reduce_dtype="bf16"', BF16, None, BF16, None),
    ('"16-true"', FP16, None, None, None),
]


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "-"


def measure(rank: int, world_size: int, config: GPTConfig, policy: tuple, steps: int = 3) -> dict:
    _, module_dtype, param_dtype, reduce_dtype, autocast = policy
    torch.manual_seed(0)
    model = GPT(config).to(module_dtype)  # "-true" precisions cast the module before sharding
    sharded = ShardedModel(model, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    gathered: set[torch.dtype] = set()
    model.h[0].attn.c_attn.register_forward_pre_hook(lambda m, a: gathered.add(m.weight.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        tokens = torch.randint(config.vocab_size, (8, config.block_size + 1), generator=generator)  # (B, T + 1)
        x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T), (B, T)
        with torch.autocast("cpu", dtype=autocast or BF16, enabled=autocast is not None):
            logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))  # (B*T, V) vs (B*T,)
        loss.backward()
        grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
        state = sharded.stats.model_state_bytes([optimizer])  # with gradients, before they are freed
        optimizer.step()
        optimizer.zero_grad()
        sharded.stats.end_step()
    last = {kind: (b.calls, b.payload_bytes) for kind, b in sharded.stats.shard_group.last_step.items()}
    return {
        "psi": sum(p.numel for p in sharded.sharded_params),
        "units": len([u for u in sharded._units if u.params]),
        "shard": {p.dtype for p in model.parameters()},
        "gathered": gathered,
        "grad": grad_dtypes,
        "last": last,
        "expected": sharded.stats.expected_step_bytes(),
        "state": state,
        "reduce": sharded._units[0].reduce_dtype,
        "loss": float(loss.detach()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="small", help="GPT preset; default small")
    args = parser.parse_args()
    config = GPTConfig(vocab_size=len(CharTokenizer(load_text()).chars), **SIZES[args.size])
    world_size = 2
    rows = []
    for policy in POLICIES:
        result = run_ranks(measure, world_size, config, policy)[0]  # rank 0's view; rank 1's is the same
        rows.append((policy, result))
    psi, units = rows[0][1]["psi"], rows[0][1]["units"]
    print(f"GPT --size {args.size}: Ψ = {psi:,} parameters, {units} units, N = {world_size} ranks; last of 3 steps")
    fp32 = rows[0][1]
    fp32_ag, fp32_rs = fp32["expected"]["all_gather"], fp32["expected"]["reduce_scatter"]
    measured = fp32["last"]["all_gather"][1] + fp32["last"]["reduce_scatter"][1]
    # The root and the last block stay gathered from forward into backward (hooks.py, Note: kept
    # for backward): the All-Gathers move 2Ψ - Ψ_root - Ψ_last, the Reduce-Scatter Ψ.
    print(
        f"fp32 expected_step_bytes(): All-Gather (2Ψ - Ψ_root - Ψ_last)·4 = {fp32_ag:,} ({fp32_ag / (4 * psi):.3f}Ψ·4)"
        f" + Reduce-Scatter Ψ·4 = {fp32_rs:,} ({fp32_rs / (4 * psi):.3f}Ψ·4)"
    )
    total = fp32_ag + fp32_rs
    print(f"  = {total:,} bytes = {total / psi:.3f}Ψ (tags and padding included); measured {measured:,}\n")
    header = (
        f"{'Trainer precision / options':<36}{'shards':>10}{'gathers':>10}{'reduce':>10}{'grads':>10}"
        f"{'all_gather':>12}{'reduce_scat':>12}{'bytes/Ψ':>8}{'= formula':>10}{'state B':>11}{'loss':>7}"
    )
    print(header)
    for (label, *_), r in rows:
        ag, rs = r["last"]["all_gather"][1], r["last"]["reduce_scatter"][1]
        exact = ag == r["expected"]["all_gather"] and rs == r["expected"]["reduce_scatter"]
        (shard,), (grad,) = r["shard"], r["grad"]
        gathered = ",".join(_name(d) for d in sorted(r["gathered"], key=str))
        print(
            f"{label:<36}{_name(shard):>10}{gathered:>10}{_name(r['reduce']):>10}{_name(grad):>10}"
            f"{ag:>12,}{rs:>12,}{(ag + rs) / psi:>8.3f}{str(exact):>10}{r['state']['total']:>11,}{r['loss']:>7.3f}"
        )
    gathers = fp32_ag / (4 * psi)  # Ψ-multiples gathered per step: 2 less the kept units' share
    print(f"\nbytes/Ψ: payload of the step per parameter, about {gathers:.3f} × the gathered dtype's bytes")
    print(f"+ 1 × the reduce dtype's: fp32 {4 * gathers + 4:.2f}; 16-bit gathers + fp32 reduce {2 * gathers + 4:.2f};")
    print(f"all 16-bit {2 * gathers + 2:.2f}. {gathers:.3f} = 2 - (Ψ_root + Ψ_last)/Ψ, tags and padding included:")
    print("the root and the last block are gathered once per step, kept from forward into backward.")
    print("state B: this rank's parameter shards + gradient shards + AdamW state, in bytes.")
    print("loss: rank 0's after 3 steps. \"16-true\" gives nan: AdamW's default eps=1e-8 is 0 in float16, so its")
    print("update divides by zero; one process without sharding does the same.")


if __name__ == "__main__":
    main()
