"""The Fabric strategy."""
