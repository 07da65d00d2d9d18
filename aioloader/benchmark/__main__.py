"""Entry point of ``python -m aioloader.benchmark``."""

from aioloader.benchmark._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
