"""``dataset``: the user's own map-style dataset (``--dataset module:factory``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset, Subset

from aioloader.benchmark._harness import (
    Config,
    Row,
    alternate,
    loader_kwargs,
    run_once,
    throughput_rows,
)


def load_factory(spec: str) -> Callable[[], Dataset[Any]]:
    """Resolve ``module:factory`` to a callable."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise SystemExit(f"--dataset wants module:factory, got {spec!r}")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise SystemExit(f"--dataset {spec!r} is not callable")
    return obj  # type: ignore[no-any-return]


def bench_dataset(cfg: Config) -> list[Row]:
    factory = load_factory(str(cfg.extra["dataset"]))
    ds: Dataset[Any] = factory()
    bs = int(cfg.extra["batch_size"])
    warmup = 2
    want = (int(cfg.extra["batches"]) + warmup) * bs
    size = len(ds)  # type: ignore[arg-type]
    if size < (warmup + 1) * bs:
        raise SystemExit(f"dataset has {size} samples; need at least {(warmup + 1) * bs}")
    if size > want:
        ds = Subset(ds, range(want))  # a fixed amount of work per round
    kwargs = loader_kwargs(cfg, bs)
    res = alternate(cfg, lambda n: run_once(n, ds, kwargs, warmup))
    label = f" ({cfg.extra['dataset']}, batch {bs})"
    rows = throughput_rows("dataset", label, res)
    rows.insert(1, throughput_rows("dataset", label, res, unit="batches")[0])
    return rows
