"""``cpu``: Pillow JPEG decode, ~1 ms of CPU per sample."""

from __future__ import annotations

import io

import torch
from torch.utils.data import Dataset

from aioloader.benchmark._harness import (
    Config,
    Row,
    plan,
    ratio_check,
    simple,
)


def make_jpeg(side: int = 320, seed: int = 0) -> bytes:
    """Encode one gradient-plus-noise RGB image; noise keeps the decoder honest (~1 ms at 320)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, side)
    img = np.add.outer(ramp, ramp)[..., None] / 2 + rng.integers(0, 64, (side, side, 3))
    buf = io.BytesIO()
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


class JpegDataset(Dataset[torch.Tensor]):
    """~1 ms of CPU per sample: decode the same JPEG with Pillow into a uint8 HWC tensor."""

    def __init__(self, n: int, jpeg: bytes) -> None:
        self.n = n
        self.jpeg = jpeg

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        import numpy as np
        from PIL import Image

        with Image.open(io.BytesIO(self.jpeg)) as im:
            arr = np.asarray(im.convert("RGB"))
        return torch.from_numpy(arr.copy())


def bench_cpu(cfg: Config) -> list[Row]:
    jpeg = make_jpeg()
    rows = simple(
        cfg, "cpu", lambda n: JpegDataset(n, jpeg), 32, plan(cfg, 40, 15), 4, label=" (batch 32)"
    )
    ratio_check(rows[0], ">=", 1.0)
    return rows
