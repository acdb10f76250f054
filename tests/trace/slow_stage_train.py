"""`deltamoe train` with one rank's pipeline stage slowed down: run under torchrun.

Usage: torchrun ... slow_stage_train.py SLOW_RANK SLEEP_S -- <deltamoe train arguments>

The slow rank sleeps before every forward chunk of its stage (torch.distributed.pipelining's
PipelineStage.forward_one_chunk, patched here, so the training code itself is unchanged): a
stage that computes slower than its data-parallel twin, which the trace analyzer must name.
"""

from __future__ import annotations

import os
import sys
import time

from torch.distributed.pipelining import PipelineStage


def main() -> int:
    slow_rank, sleep_s = int(sys.argv[1]), float(sys.argv[2])
    train_args = sys.argv[sys.argv.index("--") + 1:]
    if int(os.environ.get("RANK", "0")) == slow_rank:
        forward = PipelineStage.forward_one_chunk

        def slow_forward(self, *args, **kwargs):
            time.sleep(sleep_s)
            return forward(self, *args, **kwargs)
        PipelineStage.forward_one_chunk = slow_forward
    from deltamoe.cli import main as cli_main

    return cli_main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main())
