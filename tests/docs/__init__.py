"""The README's and the guide's code, the examples and benchmarks, run as written."""
