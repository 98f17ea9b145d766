"""Make a larger GPU look like a smaller card: hold its memory above `--gib` in this process until
killed, so the jobs beside it see an H100's free memory on an H200 (what a recipe promises must fit
an 80 GB card). Does nothing where the device is no larger.

    python bench/card.py --gib 79.65 &   # an H100 80GB's total (81,559 MiB), then run the bench
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=81559 / 1024, help="the card to look like, GiB in total")
    args = ap.parse_args()
    total = torch.cuda.mem_get_info()[1]
    extra = total - int(args.gib * 2**30)
    held = torch.empty(max(extra, 0), dtype=torch.uint8, device="cuda")  # noqa: F841  (kept until killed)
    print(f"card: {total / 2**30:.1f} GiB device, {max(extra, 0) / 2**30:.1f} GiB held, "
          f"{torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB free", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
