"""Types that help: torch's attributes are typed properties, the batch type follows collate_fn,
and mypy --strict checks a user's script against them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from aioloader import AsyncDataLoader
from tests import datasets

REPO = Path(__file__).resolve().parent.parent

TORCH_ATTRS = [
    "dataset",
    "batch_size",
    "sampler",
    "batch_sampler",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
]


def test_torch_attributes_are_listed_and_equal_torchs() -> None:
    ds = datasets.RangeDataset(10)
    gen = torch.Generator()
    kwargs = {"batch_size": 3, "num_workers": 2, "generator": gen, "drop_last": True}
    loader = AsyncDataLoader(ds, **kwargs)  # type: ignore[arg-type]
    ref = DataLoader(ds, **kwargs)  # type: ignore[arg-type]
    for obj in (loader, loader.sync()):
        assert set(TORCH_ATTRS) <= set(dir(obj))
        for name in TORCH_ATTRS:
            if name in ("sampler", "batch_sampler"):
                assert type(getattr(obj, name)) is type(getattr(ref, name)), name
            else:
                assert getattr(obj, name) == getattr(ref, name), name


def test_a_misspelt_attribute_is_an_attribute_error() -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(10), batch_size=3)
    with pytest.raises(AttributeError, match="batchsize"):
        _ = loader.batchsize  # type: ignore[attr-defined]
    loader.num_workers = 2  # settable as on torch's loader
    assert loader.sync().num_workers == 2


def test_mypy_strict_checks_a_user_script(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    script.write_text(
        textwrap.dedent(
            """
            from __future__ import annotations

            import torch
            from torch.utils.data import Dataset

            from aioloader import AsyncDataLoader


            class Squares(Dataset[torch.Tensor]):
                def __len__(self) -> int:
                    return 10

                def __getitem__(self, i: int) -> torch.Tensor:
                    return torch.tensor([i * i])


            def collate(samples: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
                return torch.stack(samples), len(samples)


            async def train() -> None:
                async with AsyncDataLoader(Squares(), batch_size=4, collate_fn=collate) as loader:
                    async for x, n in loader:
                        reveal_type(x)
                        reveal_type(n)
                    reveal_type(loader.batch_size)
                    reveal_type(loader.multiprocessing_context)
                    loader.batchsize


            def train_sync() -> None:
                with AsyncDataLoader(Squares(), collate_fn=collate).sync() as loader:
                    for batch in loader:
                        reveal_type(batch)
                    reveal_type(loader.dataset)
                default = AsyncDataLoader(Squares(), batch_size=2)
                reveal_type(default)
            """
        )
    )
    cache = tmp_path / "cache"
    if (REPO / ".mypy_cache").is_dir():  # torch's analysis from a project `mypy` run: seconds
        shutil.copytree(REPO / ".mypy_cache", cache)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), "user.py"],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    # mypy 1.x spells builtins "int", 2.x "int".
    lines = [
        re.sub(r"^user\.py:\d+: ", "", line).replace("builtins.", "")
        for line in proc.stdout.splitlines()
    ]
    assert lines == [
        'note: Revealed type is "torch._tensor.Tensor"',
        'note: Revealed type is "int"',
        'note: Revealed type is "int | None"',
        'note: Revealed type is "multiprocessing.context.BaseContext | None"',
        'error: "AsyncDataLoader[tuple[Tensor, int]]" has no attribute "batchsize"  [attr-defined]',
        'note: Revealed type is "tuple[torch._tensor.Tensor, int]"',
        'note: Revealed type is "torch.utils.data.dataset.Dataset[Any]"',
        'note: Revealed type is "aioloader._loader.AsyncDataLoader[Any]"',
        "Found 1 error in 1 file (checked 1 source file)",
    ], proc.stdout + proc.stderr
