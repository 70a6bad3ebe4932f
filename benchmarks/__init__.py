"""The benchmarks `kvferry bench` runs, to judge kvferry on the machine at hand.

Each module is one benchmark with `main(argv) -> int`: `transfer` (GB/s per executor, direction
and page size), `interference` (what transfers cost a model's matmul beside them), `planner`
(planning time on the CPU) and `stress` (a long run of the session and the `cpu` executor). Each
prints a table and one PASS/FAIL line per bar, and writes `NAME.json` and `NAME.png` under
`--out`. Importing this package imports no GPU framework.
"""
