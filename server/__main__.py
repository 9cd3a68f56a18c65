"""``python -m byteps_espresso.server``: run the scheduler or server role that DMLC_ROLE names.

Exit status: 0 when the job finished, 1 when it failed (start-up timeout, lost node, abort),
2 for a configuration error (the message names the variable).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from byteps_espresso.config import Config, ConfigError, Role

__all__ = ["ROLES", "main"]


def _scheduler(cfg: Config) -> int:
    from byteps_espresso.server.scheduler import run_scheduler

    return run_scheduler(cfg)


def _server(cfg: Config) -> int:
    from byteps_espresso.server.server import run_server

    return run_server(cfg)


def _worker(cfg: Config) -> int:
    raise ConfigError("DMLC_ROLE=worker: workers run the training script (which creates a "
                      "PSClient), not `python -m byteps_espresso.server`; set DMLC_ROLE to "
                      "scheduler or server")


ROLES: dict[Role, Callable[[Config], int]] = {
    Role.SCHEDULER: _scheduler,
    Role.SERVER: _server,
    Role.WORKER: _worker,
}


def main() -> int:
    """Parse the environment and run the role; returns the exit status."""
    try:
        cfg = Config.from_env()
        if cfg.role is not Role.WORKER and cfg.num_servers < 1:
            raise ConfigError("DMLC_NUM_SERVER=0: a parameter-server job needs at least one "
                              "server; set DMLC_NUM_SERVER")
    except ConfigError as exc:
        print(f"byteps_espresso.server: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level,
                        format=f"%(asctime)s {cfg.role.value} %(process)d %(levelname)s "
                               "%(name)s: %(message)s")
    try:
        return ROLES[cfg.role](cfg)
    except ConfigError as exc:
        print(f"byteps_espresso.server: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from byteps_espresso.server.link import RendezvousError
        from byteps_espresso.server.scheduler import SchedulerError
        from byteps_espresso.server.server import ServerError

        if not isinstance(exc, (RendezvousError, SchedulerError, ServerError)):
            logging.getLogger("byteps_espresso.server").exception("%s crashed", cfg.role.value)
        print(f"byteps_espresso.server ({cfg.role.value}): {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
