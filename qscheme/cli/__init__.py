"""The `qscheme` command line: one module per command, each with ``register`` and ``run``."""
