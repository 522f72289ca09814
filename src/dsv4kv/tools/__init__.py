"""Tools on top of the library: the command line (cli.py), the serving demo (demo.py) and the benchmarks (bench/)."""
