"""What users call beside the strategy: callbacks, `grad_norm`, the estimate (docs/design.md, "The glue")."""
