"""Start the ranks of a several-GPU run on this machine through torch's elastic launcher (what torchrun runs).

`qwen-image generate --gpus N` and `qwen-image ui --gpus N` hand their own command line to `launch_ranks`;
each rank finds WORLD_SIZE, RANK and LOCAL_RANK in its environment, joins the process group and takes GPU
LOCAL_RANK (pipelines/parallel.py). `torchrun --nproc_per_node N -m qwen_image_fusion.ui.cli ...` does the
same. When a rank fails the launcher stops the others at once, so no rank waits on a dead one.
"""

import logging
import uuid

from qwen_image_fusion.models.errors import QwenImageError

USER_ERROR_STATUS = 2  # a rank's exit status after it printed a user error (ui/cli.py)


class RanksFailed(QwenImageError):
    """A rank exited with an error; the launcher stopped the others."""

    def __init__(self, rank: int, status: int) -> None:
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        super().__init__(f"rank {rank} {how} (its output is above); the other ranks were stopped")
        self.rank, self.status = rank, status


def launch_ranks(ranks: int, command: list[str]) -> None:
    """Run `command` (program first) as `ranks` processes on this host and wait for all of them; raises
    RanksFailed naming the first rank that failed, KeyboardInterrupt when interrupted (the launcher
    passes the signal on to the ranks)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=ranks,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone
        max_restarts=0,
        monitor_interval=0.1,
    )
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # RanksFailed says it
    try:
        elastic_launch(config, command[0])(*command[1:])
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        raise RanksFailed(rank, failure.exitcode) from None
    except SignalException:
        raise KeyboardInterrupt from None
