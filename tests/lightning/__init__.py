"""The Trainer strategy and what users call beside it (Lightning's own tests adapted, the CLI)."""
