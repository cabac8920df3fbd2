"""What a launcher (torchrun, `qwen-image --gpus N`) told this process, torch-free: its rank and the world
size. Rank 0 leads: it prints, writes files and serves the web demo."""

import os

LEADER_RANK = 0


def launched_rank() -> int:
    """This process's rank; 0 when run directly."""
    return int(os.environ.get("RANK", str(LEADER_RANK)))


def launched_world_size() -> int:
    """The world size a launcher gave this process; 1 when run directly."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_leader_process() -> bool:
    """Rank 0 of a launched run, or a plain process: the one that prints, writes files and serves."""
    return launched_rank() == LEADER_RANK
