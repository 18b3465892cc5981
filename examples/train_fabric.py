"""Train the character-level GPT of train_gpt.py with Lightning Fabric and ZeRO stage 3.

    python examples/train_fabric.py                                   # 2 ranks on the CPU
    python examples/train_fabric.py --size tiny --steps 50 --save runs/fabric     # sharded checkpoint
    python examples/train_fabric.py --size tiny --steps 80 --resume runs/fabric --devices 3

The same model and data as train_gpt.py (nothing is downloaded), written as a plain PyTorch
loop: Fabric launches the ranks, `fabric.setup` shards the model (each rank keeps 1/N of every
parameter, gradient and optimizer state), `fabric.backward` gathers and reduce-scatters,
`fabric.clip_gradients` clips by the norm of the whole gradient, and `fabric.save`/`fabric.load`
write and read sharded checkpoints that resume at any number of ranks.
"""

from __future__ import annotations

import argparse
import math
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from train_gpt import GPT, SIZES, CharTokenizer, GPTConfig, RandomWindows, load_text

from lightning_zero3 import ZeRO3FabricStrategy


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay for nn.Linear weights only, chosen by name: after sharding every parameter is
    1-D, so `p.dim()` cannot tell a matrix from a bias."""
    modules = dict(model.named_modules())
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        (decay if isinstance(modules[owner], nn.Linear) and attr == "weight" else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, total // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(fabric: L.Fabric, model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in loader]  # (B*T, V) vs (B*T,)
    model.train()
    return float(fabric.all_reduce(torch.stack(losses).mean()))  # mean over ranks


@torch.no_grad()
def sample(model: nn.Module, tokenizer: CharTokenizer, prompt: str, length: int, block_size: int) -> str:
    """Every rank runs the same forwards (they gather each unit together), drawing the same
    characters from a generator seeded alike on every rank."""
    model.eval()
    generator = torch.Generator().manual_seed(0)
    idx = tokenizer.encode(prompt).unsqueeze(0)  # (1, T)
    for _ in range(length):
        logits = model(idx[:, -block_size:].to(next(model.parameters()).device))[:, -1, :]  # (1, V)
        next_id = torch.multinomial(F.softmax(logits.float().cpu(), dim=-1), 1, generator=generator)  # (1, 1)
        idx = torch.cat([idx, next_id], dim=1)  # (1, T + 1)
    return tokenizer.decode(idx[0].tolist())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="ranks (processes); default 2")
    parser.add_argument("--accelerator", default="cpu", help="cpu (default), gpu, or auto")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in total; default 200")
    parser.add_argument("--size", choices=list(SIZES), default="small", help="model preset; default small")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per rank per step; default 32")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate; default 3e-3")
    parser.add_argument("--precision", default="32-true", help="Fabric precision, e.g. bf16-mixed; default 32-true")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--save", metavar="PATH", help="write a sharded checkpoint (a directory) at the end")
    parser.add_argument("--resume", metavar="PATH", help="resume from a checkpoint saved at any number of ranks")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    fabric = L.Fabric(
        strategy=ZeRO3FabricStrategy(prefetch=1),  # or strategy="zero3"
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
    )
    fabric.launch()  # re-runs this script once per extra rank
    fabric.seed_everything(args.seed)

    text = load_text()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    split = int(0.9 * len(data))  # first 90% train, last 10% validation
    config = GPTConfig(vocab_size=len(tokenizer.chars), **SIZES[args.size])
    global_batch = args.batch_size * args.devices
    train = RandomWindows(data[:split], config.block_size, global_batch * args.steps, args.seed)
    val = RandomWindows(data[split:], config.block_size, global_batch * 2, args.seed + 1)
    # setup_dataloaders gives each rank its share (a DistributedSampler) and moves batches to the device.
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(train, batch_size=args.batch_size, shuffle=True), DataLoader(val, batch_size=args.batch_size)
    )

    model = GPT(config)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)  # now 1-D shards; the optimizer holds them
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)  # shards for this run's number of ranks; restores state["step"]
        fabric.print(f"resumed from {args.resume} at step {state['step']}")

    start = time.perf_counter()
    batches = iter(train_loader)
    while state["step"] < args.steps:
        x, y = next(batches)  # (B, T), (B, T)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(state["step"], args.steps, args.lr)
        logits = model(x)  # (B, T, V): each block gathered just before it runs, freed right after
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        fabric.backward(loss)  # gathers again, reduce-scatters each block's gradient to its shards
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # norm of the whole gradient
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        if state["step"] % 25 == 0 or state["step"] == args.steps:
            fabric.print(f"step {state['step']:4d}  loss {loss.item():.3f}  grad norm {float(norm):.3f}")
    wall_s = time.perf_counter() - start

    val_loss = evaluate(fabric, model, val_loader)
    if args.save:
        fabric.save(args.save, state)  # every rank writes its own shards; nothing is gathered
    text = sample(model, tokenizer, "The ", 80, config.block_size)
    held = fabric.strategy.sharded_model(model).stats.model_state_bytes([optimizer])
    mine = held["param"] + held["optimizer"]  # gradients were freed by zero_grad
    numel = sum(fabric.strategy.sharded_model(model).whole_numel(p) for p in model.parameters())
    fabric.print(f"\nval loss {val_loss:.3f} after {state['step']} steps ({wall_s:.1f} s)")
    fabric.print(f"sample: {text!r}")
    fabric.print(
        f"parameters + AdamW state on this rank: {mine:,} bytes; DDP holds {12 * numel:,} on every rank "
        f"({mine / (12 * numel):.3f})"
    )


if __name__ == "__main__":
    main()
