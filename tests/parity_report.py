"""Print the parity figures: N gloo ranks against one process on the global batch, for each
behaviour the engine must keep exact. The same recipes the tests check, as one table.

    python -m tests.parity_report
"""

from __future__ import annotations

import time
from functools import partial

from tests.support.models import MLP, ReusedBlockModel, TinyGPT, gpt_batch, mlp_batch, mlp_frozen_block
from tests.support.parity import (
    Recipe,
    adamw,
    adamw_large_eps,
    lm_loss,
    no_decay_for_biases_and_norms,
    run_parity,
    sgd,
)
from tests.support.ranks import run_ranks


def gpt_batch_of_12(seed: int):  # divisible by 2, 3 and 4 ranks
    return gpt_batch(seed, batch=12)


RECIPES = {
    "SGD": Recipe(model=MLP, batch=mlp_batch, optimizer=sgd, steps=4),
    "AdamW": Recipe(model=MLP, batch=mlp_batch, optimizer=adamw, steps=4),
    "AdamW, param groups by name": Recipe(
        model=MLP, batch=mlp_batch, optimizer=adamw, param_groups=no_decay_for_biases_and_norms
    ),
    "tied weights (GPT), AdamW": Recipe(model=TinyGPT, batch=gpt_batch_of_12, loss=lm_loss, optimizer=adamw_large_eps),
    "module called twice": Recipe(model=ReusedBlockModel, batch=mlp_batch, optimizer=adamw),
    "checkpointing, reentrant": Recipe(model=partial(MLP, checkpointing="reentrant"), batch=mlp_batch, optimizer=adamw),
    "checkpointing, non-reentrant": Recipe(
        model=partial(MLP, checkpointing="non_reentrant"), batch=mlp_batch, optimizer=adamw
    ),
    "accumulation x3": Recipe(model=MLP, batch=mlp_batch, optimizer=adamw, accumulate=3),
    "clip by norm 0.05": Recipe(model=MLP, batch=mlp_batch, optimizer=sgd, clip_norm=0.05),
    "clip by value 0.01": Recipe(model=MLP, batch=mlp_batch, optimizer=sgd, clip_value=0.01),
    "frozen block": Recipe(model=mlp_frozen_block, batch=mlp_batch, optimizer=adamw),
    "persistence_threshold=64": Recipe(
        model=MLP, batch=mlp_batch, optimizer=adamw, sharded_kwargs={"persistence_threshold": 64}
    ),
    "prefetch=2": Recipe(model=MLP, batch=mlp_batch, optimizer=adamw, sharded_kwargs={"prefetch": 2}),
}


def main() -> None:
    print("| behaviour | ranks | max param diff | max shard-grad diff | max loss diff |")
    print("|---|---|---|---|---|")
    start = time.perf_counter()
    for name, recipe in RECIPES.items():
        for world_size in (2, 3):
            worst = run_ranks(run_parity, world_size, recipe)
            param = max(w["param"] for w in worst)
            grad = max(w["grad"] for w in worst)
            loss = max(w["loss"] for w in worst)
            print(f"| {name} | {world_size} | {param:.1e} | {grad:.1e} | {loss:.1e} |", flush=True)
    hybrid = Recipe(model=MLP, batch=mlp_batch, optimizer=adamw, sharded_kwargs={"shard_size": 2})
    worst = run_ranks(run_parity, 4, hybrid)
    print(f"| shard_size=2 (2 groups of 2) | 4 | {max(w['param'] for w in worst):.1e} | "
          f"{max(w['grad'] for w in worst):.1e} | {max(w['loss'] for w in worst):.1e} |")  # fmt: skip
    print(f"\n({time.perf_counter() - start:.0f} s; fp32; every step compared, several steps per recipe)")


if __name__ == "__main__":
    main()
