"""``make demo``: the main job end to end on a built-in default.

For now it writes a store of generated features (shaped like real VAE latents and unpadded text
embeddings) and prints ``mmcache info`` of it; the encode and train stages extend it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from featstore.cli import echo_info
from featstore.demo import write_demo_store
from featstore.verify import store_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="demo", help="folder for the demo's store and runs")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    store_url = str(out / "store")
    store = write_demo_store(store_url)
    echo_info(store_info(store))
    print(f"\nstore written to {store.url}\nnext: mmcache verify {store.url}")


if __name__ == "__main__":
    main()
