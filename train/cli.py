"""The ``mmtrain`` command."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mmcache")
def cli() -> None:
    """mmtrain: train models on features cached by `mmcache encode`."""


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
