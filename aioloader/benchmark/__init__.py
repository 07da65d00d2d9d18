"""Benchmark aioloader against torch's DataLoader: ``python -m aioloader.benchmark``.

Layout: ``_harness`` (rows, timers, running and alternating loaders), ``_report`` (table, JSON
machine block, chart), ``_cli`` (flags and the workload registry) and one module per workload
(``tiny``, ``cpu``, ``iowait``, ``big``, ``skewed``, ``startup``, ``loop_lag``, ``device``,
``stream``, ``remote``, ``user_dataset``); ``_store`` is the HTTP object store that ``remote``,
the tests and the examples read from. A new workload is a module with a
``bench_*(cfg) -> list[Row]`` function, registered in ``_cli.BENCHES`` and ``_cli.WORKLOADS``.
"""

from aioloader.benchmark._cli import main, parse_args

__all__ = ["main", "parse_args"]
