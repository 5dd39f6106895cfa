"""torchrun targets for tests/stages/test_teacher_ddp.py, imported by name in the ranks.

Apart from the test module so that a rank imports torch.distributed alone, not the test's imports
(the teacher recipe, Opacus, transformers): seconds less per rank, and the ranks start together.
"""

from __future__ import annotations

import time

import torch.distributed as dist


def rank1_fails_while_rank0_works(args: dict, on_progress) -> None:
    """Rank 1 fails at once, rank 0 is still at work, without a line logged, when torchrun stops it."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    time.sleep(120)
