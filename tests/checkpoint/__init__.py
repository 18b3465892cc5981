"""Sharded and full checkpoints (lightning_zero3/checkpoint/): format, save, load, consolidate."""
