"""Engine-facing glue: the command line, configuration, engine-shaped facades.

Adapters may do I/O; they never hold planning rules (those live in `kvferry.core`).
"""
