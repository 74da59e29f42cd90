"""Experiments as code: a committed spec (``experiments/NAME.yaml``) says what a table depends on, and
``comap experiment run`` trains, evaluates and writes ``results/NAME`` from it (docs/experiments.md).

A driver of the system's processes, as the benchmarks are: it imports them, none imports it."""
