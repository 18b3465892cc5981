"""What the Trainer's `ZeRO3Strategy` and Fabric's `ZeRO3FabricStrategy` share (docs/design.md, "The glue")."""
