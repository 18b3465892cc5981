"""The tests' shared helpers: launching ranks, models, LightningModules, parity checks."""
