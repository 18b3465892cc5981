"""Jobs started as users start them: several nodes, ranks lost or late, clean exits."""
