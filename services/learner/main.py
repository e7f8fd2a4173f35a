"""``asymptote learner``: parse config, set up logging, run the learner.

The training loop: ask the broker for a batch, step, bump the policy
version, snapshot the weights for generators, announce the version in the
KV bucket, write the step's metrics; checkpoint every N steps and only then
ack the batches the checkpoint holds, so a crash replays them. Under
torchrun with several ranks, rank 0 is the service and the others follow
its steps (services/learner/distributed.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from asymptote.cli_args import service_parser
from asymptote.config import load_config, log_resolved
from asymptote.lifecycle import die_with_launcher, run_until_stopped
from asymptote.logs import setup_logging
from services.learner.config import LearnerConfig

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("learner", LearnerConfig, "ASY_LEARNER")
    parser.add_argument("--config", type=Path, help="YAML config file")
    args = parser.parse_args(argv)
    config = load_config(LearnerConfig, args.config, "ASY_LEARNER")
    setup_logging("learner", config.log_format)
    log_resolved(config, "learner")
    for warning in config.warnings(_num_parameters(config.model_dir)):
        log.warning("%s", warning)
    # Imports torch: only after the config is valid.
    from services.learner.distributed import DataParallel
    from services.learner.loop import follow, serve

    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: it ends with its launcher
        die_with_launcher()
    _check_fits(config)
    dp = DataParallel.from_env(config.dist_backend, config.dist_timeout_s, config.device)
    if not dp.is_main:
        return follow(config, dp)
    return run_until_stopped(lambda stop: serve(config, stop, dp))


def _check_fits(config: LearnerConfig) -> None:
    """On a GPU, before anything is allocated: the memory planner's check of this rank (``asymptote plan``'s
    formula); ConfigError in one line, naming the setting to change, when it does not fit."""
    import torch

    from services.learner.memory import learner_fits
    from services.learner.model import Precision

    precision = Precision.resolve(config.device, config.dtype)
    if precision.device.type != "cuda":
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = learner_fits(
        config.model_dir,
        config,
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        gpu_memory_bytes=torch.cuda.get_device_properties(precision.device).total_memory,
    )
    log.info("memory plan of this rank: %.1f GiB, %.0f%% of its GPU", plan.total_bytes / 2**30, 100 * plan.fraction)


def _num_parameters(model_dir: Path) -> int | None:
    """The model's size for the config's warnings; None when unreadable (loading it says why)."""
    from asymptote.codec import count_stored_parameters
    from asymptote.errors import WeightsError

    try:
        return count_stored_parameters(model_dir)
    except (OSError, WeightsError) as exc:
        log.debug("could not count the parameters in %s: %s", model_dir, exc)
        return None
