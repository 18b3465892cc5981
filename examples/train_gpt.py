"""Train a small character-level GPT with ZeRO stage 3 on two CPU processes.

    python examples/train_gpt.py                                  # 2 ranks on the CPU, 1-2 minutes
    python examples/train_gpt.py --size tiny --steps 50           # a smoke run, ~15 s
    python examples/train_gpt.py --accelerator gpu --devices 2    # NCCL (not yet run on GPUs)
    python examples/train_gpt.py --size tiny --steps 20 --save runs/gpt       # sharded checkpoint
    python examples/train_gpt.py --size tiny --steps 40 --resume runs/gpt --devices 3
    python examples/train_gpt.py --size tiny --steps 20 --precision bf16-mixed   # 16-bit gathers
    python examples/train_gpt.py --size tiny --steps 20 --devices 4 --shard-size 2   # 2 groups of 2
    python examples/train_gpt.py --size tiny --steps 20 --quantize-weights --quantize-gradients int8

The text is Python's own help topics (`pydoc_data.topics`, shipped with every CPython), so
nothing is downloaded. The model is nanoGPT-shaped: token + position embedding, pre-LN causal
self-attention blocks in an `nn.ModuleList`, a final LayerNorm and an LM head tied to the token
embedding. `ZeRO3Strategy` makes each block a unit (the automatic wrap policy picks repeated
children of a ModuleList); the embeddings, final LayerNorm and tied head form the root unit.

At the end, rank 0 prints what the strategy measured: model-state bytes per rank against DDP's
16 bytes per parameter, and the bytes each collective moved in the last training step against
the formula in docs/accounting.md (with `--shard-size`, also what crossed between the groups).
Every step's figures go to a CSV log by `ShardingStatsMonitor` (`--log-dir`, default `logs`),
which `python examples/plot_stats.py logs/train_gpt/version_0/metrics.csv` plots.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_zero3 import ShardingStatsMonitor, ZeRO3Strategy
from lightning_zero3.tools.estimate import parse_option

# ---------------------------------------------------------------------------------------------
# Model


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int  # context length
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0


SIZES = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64),  # ~0.1M parameters: a smoke test
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),  # ~0.8M: the default, CPU
    "medium": dict(n_layer=6, n_head=8, n_embd=256, block_size=128),  # ~4.8M: give it a GPU
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key, value at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time, channels (n_embd)
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])  # one ZeRO-3 unit each
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one parameter, two modules
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: scale residual projections by depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape  # batch, time
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size)


# ---------------------------------------------------------------------------------------------
# Data: Python's help topics as one string, encoded one character per token


def load_text() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


class CharTokenizer:
    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {ch: i for i, ch in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[ch] for ch in text], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class RandomWindows(Dataset):
    """`length` windows of `block_size + 1` characters at random offsets (fixed by `seed`):
    input = window[:-1], target = window[1:]."""

    def __init__(self, data: torch.Tensor, block_size: int, length: int, seed: int) -> None:
        self.data = data
        self.block_size = block_size
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(len(data) - block_size - 1, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[i])
        window = self.data[start : start + self.block_size + 1]  # (T + 1,)
        return window[:-1], window[1:]  # (T,), (T,)


# ---------------------------------------------------------------------------------------------
# LightningModule


class CharGPT(L.LightningModule):
    def __init__(self, config: GPTConfig, *, lr: float, weight_decay: float) -> None:
        super().__init__()
        self.model = GPT(config)
        self.lr = lr
        self.weight_decay = weight_decay
        self.train_losses: list[float] = []  # (this rank's) loss at every step, for the report
        self.step_clock: list[float] = []  # perf_counter at each training step, for --results
        self.first_step = 0  # global step training started from (not 0 when resuming)
        # The strategy's accounting (`strategy.stats`), read before teardown dissolves the shards.
        self.zero3_stats: dict = {}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        logits = self(x)  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))  # (B*T, V) vs (B*T,)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.train_losses.append(loss.item())
        self.step_clock.append(time.perf_counter())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def on_train_start(self) -> None:
        self.first_step = self.trainer.global_step

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        # Right after the last optimizer step every rank holds its shards, their gradients and
        # AdamW state; Lightning frees the gradients before validation, so measure it here.
        if self.trainer.global_step >= self.trainer.max_steps:
            self.zero3_stats["model_state_bytes"] = self.trainer.strategy.stats["model_state_bytes"]
            self.zero3_stats["bytes_per_element"] = next(self.parameters()).element_size()

    def on_train_end(self) -> None:
        self.zero3_stats = {
            **self.trainer.strategy.stats,
            "bytes_per_element": next(self.parameters()).element_size(),
            **self.zero3_stats,
        }

    def configure_optimizers(self) -> dict:
        # Under ZeRO-3 every registered parameter is a 1-D shard, so `p.dim() >= 2` cannot tell
        # a matrix from a bias. Decide by name instead: only the weights of nn.Linear layers decay;
        # biases, LayerNorm weights and embeddings (the tied LM head is the token embedding) do not.
        modules = dict(self.named_modules())
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            owner_name, _, attr = name.rpartition(".")
            is_matrix = isinstance(modules[owner_name], nn.Linear) and attr == "weight"
            (decay if is_matrix else no_decay).append(param)
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        # Linear warm-up for the first 10% of the steps, then cosine decay to 10% of the peak.
        total = max(1, self.trainer.max_steps)
        warmup = max(1, total // 10)

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ---------------------------------------------------------------------------------------------
# After training: a sample and the report


@torch.no_grad()
def sample(model: GPT, tokenizer: CharTokenizer, prompt: str, length: int) -> str:
    """`length` characters sampled (temperature 1) after `prompt`, one process, no sharding."""
    model.eval()
    idx = tokenizer.encode(prompt).unsqueeze(0).to(next(model.parameters()).device)  # (1, T)
    for _ in range(length):
        context = idx[:, -model.config.block_size :]  # (1, <= block_size)
        logits = model(context)[:, -1, :]  # (1, T, V) -> (1, V): the last position
        next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (1, 1)
        idx = torch.cat([idx, next_id], dim=1)  # (1, T + 1)
    return tokenizer.decode(idx[0].tolist())


def report(stats: dict, *, prefetch: int, steps: int, wall_s: float, module: CharGPT, val: float | None) -> None:
    n = stats["world_size"]
    g = stats["shard_size"]  # ranks one copy of the model is sharded over: N, or G with --shard-size
    psi = stats["full_parameters"]
    b = stats["bytes_per_element"]  # of the shards, their gradients and AdamW state: 4 in fp32
    print(f"\n=== ZeRO-3 report: rank 0 of {n}, {steps} steps, fit took {wall_s:.1f} s ===")
    val_text = f", val loss (mean over ranks) {val:.3f}" if val is not None else ""
    losses, first = module.train_losses, module.first_step + 1
    print(f"train loss (rank 0): step {first} {losses[0]:.3f} -> step {steps} {losses[-1]:.3f}{val_text}")
    print(f"whole parameters: Ψ = {psi:,}; b = {b} bytes per element; units: {stats['units']} (blocks + root)")
    shard_dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
    if {stats["param_dtype"], stats["reduce_dtype"]} != {shard_dtype}:
        print(
            f"dtypes: shards (the optimizer's master copy) {shard_dtype}, gathers {stats['param_dtype']}, "
            f"gradients reduced in {stats['reduce_dtype']}"
        )
    if g != n:
        print(f"hierarchical sharding: {n // g} groups of {g} ranks; each group holds one sharded copy")

    # DDP keeps everything whole on every rank: in fp32, 4 (param) + 4 (grad) + 8 (AdamW m, v) = 16Ψ.
    state = stats["model_state_bytes"]
    print("\nmodel state between steps, bytes         this rank   DDP (every rank)   ratio")
    for key, ddp in (("param", b * psi), ("grad", b * psi), ("optimizer", 2 * b * psi), ("total", 4 * b * psi)):
        print(f"  {key:<36}{state[key]:>12,}{ddp:>19,}{state[key] / ddp:>8.3f}")
    over = "N" if g == n else "G"
    print(f"  (1/{over} = {1 / g:.3f}; above it only by the padding of each parameter to ceil(numel/{over}))")

    last = stats["last_step"]
    where = "" if g == n else f" inside this rank's group of {g}"
    print(f"\ncommunication in the last full training step, this rank{where}:")
    print(f"  {'collective':<16}{'calls':>6}{'payload bytes':>16}{'wire bytes':>14}")
    for kind, count in sorted(last.items()):
        print(f"  {kind:<16}{count['calls']:>6}{count['payload_bytes']:>16,}{count['wire_bytes']:>14,}")
    expected = stats["expected_step_bytes"]
    payload = sum(last.get(k, {}).get("payload_bytes", 0) for k in ("all_gather", "reduce_scatter"))
    wire = sum(last.get(k, {}).get("wire_bytes", 0) for k in ("all_gather", "reduce_scatter"))
    ddp_wire = 2 * (n - 1) / n * psi * b
    # The unit tag is 32 bits: one element of a 32-bit dtype, two of a 16-bit one (engine/unit.py).
    tag = "1 tag element" if stats["param_dtype"] in ("float32", "float64") else "a 32-bit tag (2 elements)"
    print(
        f"  formula (padded shards + {tag} per rank per unit, rows rounded up to 16 bytes): all_gather "
        f"{expected['all_gather']:,}, reduce_scatter {expected['reduce_scatter']:,}"
    )
    print(
        f"  All-Gather 2Ψ-Ψ_root-Ψ_last + Reduce-Scatter Ψ payload {payload:,} = {payload / (psi * b):.3f} Ψb "
        f"(DDP: one All-Reduce of Ψb = {psi * b:,})"
    )
    across = stats["last_step_across_groups"]
    if across:
        print(f"\nacross the {n // g} groups (one All-Reduce per unit of this rank's 1/{g} of the gradient):")
        for kind, count in sorted(across.items()):
            print(f"  {kind:<16}{count['calls']:>6}{count['payload_bytes']:>16,}{count['wire_bytes']:>14,}")
        expected_across = stats["expected_step_bytes_across_groups"]["all_reduce"]
        print(f"  formula (shard gradients + 1 tag element per unit, in {stats['reduce_dtype']}): {expected_across:,}")
        wire += sum(count["wire_bytes"] for count in across.values())
    in_slices = stats["last_step_in_slice_groups"]
    if in_slices:
        print("\nbackward's All-Gathers inside the groups of reshard_after_forward=G (slices kept after forward):")
        for kind, count in sorted(in_slices.items()):
            print(f"  {kind:<16}{count['calls']:>6}{count['payload_bytes']:>16,}{count['wire_bytes']:>14,}")
        print(f"  formula: {stats['expected_step_bytes_in_slice_groups']['all_gather']:,}")
        wire += sum(count["wire_bytes"] for count in in_slices.values())
    if n > 1:
        print(f"  sent on a ring {wire:,} = {wire / ddp_wire:.3f}x DDP's 2(N-1)/N·Ψb = {ddp_wire:,.0f}")
    print(
        f"\nunits holding whole parameters: peak {stats['peak_units_alive']} during a step "
        f"(root + 1 computing + prefetch {prefetch}), {stats['units_alive']} between steps"
    )


# ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="ranks (processes); default 2")
    parser.add_argument("--accelerator", default="cpu", help="cpu (default), gpu, or auto")
    parser.add_argument("--steps", type=int, default=250, help="optimizer steps (max_steps); default 250")
    parser.add_argument("--size", choices=list(SIZES), default="small", help="model preset; default small")
    parser.add_argument("--prefetch", type=int, default=1, help="units All-Gathered ahead; default 1")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per rank per step; default 32")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate; default 3e-3")
    parser.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed; default 32-true")
    parser.add_argument("--shard-size", type=int, help="shard within groups of this many ranks; default: all ranks")
    parser.add_argument("--param-dtype", help="gather dtype, e.g. bf16; default: what --precision implies")
    parser.add_argument("--reduce-dtype", help="gradient reduction dtype, e.g. bf16; default fp32")
    parser.add_argument(
        "--reshard-after-forward", type=parse_option, default=True,
        help="true (default), false (units whole from forward to backward) or G (a 1/G slice, gathered in groups of G)",
    )  # fmt: skip
    parser.add_argument("--quantize-weights", action="store_true", help="int8 All-Gathers of weights (ZeRO++ qwZ)")
    parser.add_argument("--quantize-gradients", type=parse_option, default=False,
                        help="int8 (or true) or int4: quantized gradient reduction (ZeRO++ qgZ); default off")
    parser.add_argument("--results", metavar="FILE", help="rank 0 saves each step's loss, the whole weights, the stats")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--save", metavar="PATH", help="write a sharded checkpoint (a directory) at the end")
    parser.add_argument("--resume", metavar="PATH", help="resume from a checkpoint, saved at any number of ranks")
    parser.add_argument("--log-dir", default="logs", help="CSV logs: DIR/train_gpt/version_N/metrics.csv; default logs")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    L.seed_everything(args.seed, verbose=False)

    text = load_text()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    split = int(0.9 * len(data))  # first 90% train, last 10% validation
    config = GPTConfig(vocab_size=len(tokenizer.chars), **SIZES[args.size])

    # One window per sequence of the run (the DistributedSampler gives each rank its share);
    # validation uses a fixed set of windows from the held-out text.
    global_batch = args.batch_size * args.devices
    train = RandomWindows(data[:split], config.block_size, global_batch * args.steps, args.seed)
    val = RandomWindows(data[split:], config.block_size, global_batch * 4, args.seed + 1)
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val, batch_size=args.batch_size)

    module = CharGPT(config, lr=args.lr, weight_decay=0.1)
    trainer = L.Trainer(
        strategy=ZeRO3Strategy(
            prefetch=args.prefetch,
            shard_size=args.shard_size,
            param_dtype=args.param_dtype,
            reduce_dtype=args.reduce_dtype,
            reshard_after_forward=args.reshard_after_forward,
            quantize_weights=args.quantize_weights,
            quantize_gradients=args.quantize_gradients,
        ),
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        val_check_interval=max(1, args.steps // 5),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,  # clipped by the global norm over all shards (one All-Reduce)
        log_every_n_steps=10,
        logger=CSVLogger(args.log_dir, name="train_gpt"),
        callbacks=[ShardingStatsMonitor()],  # each step's bytes, gather wait, units whole, memory
        enable_checkpointing=False,
    )
    start = time.perf_counter()
    trainer.fit(module, train_loader, val_loader, ckpt_path=args.resume)
    wall_s = time.perf_counter() - start
    if args.save:
        trainer.save_checkpoint(args.save)  # every rank writes its own shards; nothing is gathered

    # After fit the module stays sharded; every rank joins the gather of whole weights to rank 0.
    whole = trainer.strategy.full_state_dict()
    if trainer.global_rank == 0:
        plain = GPT(config)  # an ordinary module, in this process's memory only
        plain.load_state_dict({key.removeprefix("model."): value for key, value in whole.items()})
        print("\nsample:", repr(sample(plain, tokenizer, "The ", 120)))
        val = trainer.callback_metrics.get("val_loss")
        print(f"\nper-step figures: {trainer.logger.log_dir}/metrics.csv (python examples/plot_stats.py FILE)")
        if args.results:  # for side-by-side comparisons (benchmarks/quantized.py)
            torch.save({"losses": module.train_losses, "weights": whole, "stats": module.zero3_stats,
                        "wall_s": wall_s, "steps": trainer.global_step, "clock": module.step_clock},
                       args.results)  # fmt: skip
        report(
            module.zero3_stats,
            prefetch=args.prefetch,
            steps=trainer.global_step,
            wall_s=wall_s,
            module=module,
            val=None if val is None else float(val),
        )


if __name__ == "__main__":
    main()
