"""The ``mmcache`` command: the store commands from ``featstore.cli`` plus ``encode``.
Heavy imports (torch, dask, encoders) happen inside the commands that need them, so
``mmcache info`` stays fast and works without them."""

from __future__ import annotations

from featstore.cli import cli


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
