"""The benchmarks that regenerate the tables users read (README.md, docs/*.md), behind one entry point:

    python -m benchmarks                 # each benchmark and the table or result files it writes
    python -m benchmarks NAME [ARGS]     # run one; python -m benchmarks NAME --help for its options

One module per benchmark, `benchmarks/<name>.py`: its docstring (first line: what it measures; the rest: how),
`WRITES` (the results it writes) and `main(argv)`. Adding a benchmark is adding such a module. A benchmark
imports no other benchmark and reaches prunelight only through its public API and `prunelight.bench`
(tests/test_benchmarks.py checks both).
"""
