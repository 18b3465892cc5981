"""The engine on a bare nn.Module (lightning_zero3/engine/), on gloo ranks."""
