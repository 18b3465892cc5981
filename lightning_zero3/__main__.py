"""`python -m lightning_zero3 consolidate SRC DST`: one ordinary checkpoint file from a sharded
checkpoint directory, offline (docs/checkpoints.md). `python -m lightning_zero3 estimate ...`:
per-rank memory and bytes per step before launching (tools/estimate.py)."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no stubs

from lightning_zero3.checkpoint import CheckpointError, Progress, consolidate_checkpoint
from lightning_zero3.engine import DTYPE_NAMES
from lightning_zero3.tools import estimate


class ProgressBar:
    """tqdm's bar of the bytes written (tqdm comes with Lightning), the tensors done as its
    postfix; nothing when `stream` is not a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.bar: tqdm | None = None  # made at the first report, which knows the total

    def __call__(self, p: Progress) -> None:
        if self.bar is None:
            self.bar = tqdm(
                total=p.bytes_total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self.stream,
                disable=not self.stream.isatty(),
                desc="consolidate",
            )
        self.bar.set_postfix_str(f"{p.tensors_done}/{p.tensors_total} tensors", refresh=False)
        self.bar.update(p.bytes_done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_zero3", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    consolidate = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint directory as one ordinary checkpoint file",
        description="Write the sharded checkpoint SRC (a directory saved with ZeRO3Strategy(state_dict_type="
        "'sharded')) as one Lightning checkpoint file DST, loadable with torch.load and "
        "LightningModule.load_from_checkpoint at any world size. Streams one tensor at a time.",
    )
    flag = consolidate.add_argument
    flag("src", help="sharded checkpoint directory")
    flag("dst", help="file to write")
    flag("--weights-only", action="store_true", help="leave out optimizer states, LR schedulers and callback states")
    flag("--dtype", choices=sorted(DTYPE_NAMES), help="cast the floating-point tensors of the state dict")
    flag("--safetensors", action="store_true", help="write a safetensors file of the state dict instead")
    flag("--no-verify", action="store_true", help="skip the CRC-32 check of the shard files")
    flag(
        "--trust-checkpoint",
        action="store_true",
        help="unpickle the checkpoint's pickles (DCP's .metadata, trainer_state.pt) without restriction: they "
        "can run code, so only for checkpoints from a trusted source (see docs/checkpoints.md)",
    )
    estimate.add_arguments(
        commands.add_parser(
            "estimate",
            help="per-rank memory and bytes sent per step under ZeRO-3, before launching",
            description=estimate.__doc__.split("\n\n")[0] if estimate.__doc__ else None,
        )
    )
    return parser


def _return_freed_tensors_to_the_os() -> None:
    """A fixed 1 MiB mmap threshold (glibc's `mallopt`) gives each freed tensor back to the OS at
    once: consolidating 12 tensors of 16 MiB added 27 MiB to the peak with it, 51 without
    (docs/checkpoints.md). The command's own process only, never a user's. No-op without glibc."""
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "estimate":
        try:
            print(estimate.run(args))
        except (ValueError, ImportError, AttributeError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    progress = ProgressBar(sys.stderr)
    try:
        summary = consolidate_checkpoint(
            args.src,
            args.dst,
            weights_only=args.weights_only,
            dtype=args.dtype,
            safetensors=args.safetensors,
            verify=not args.no_verify,
            progress=progress,
            trusted=args.trust_checkpoint,
        )
    except (CheckpointError, OSError) as err:
        progress.close()  # ends the bar's line before the error
        print(f"error: {err}", file=sys.stderr)
        return 1
    progress.close()
    print(summary.line())
    return 0


if __name__ == "__main__":  # the command's own process: its allocator is ours to set
    _return_freed_tensors_to_the_os()
    sys.exit(main())
