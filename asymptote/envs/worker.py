"""An environment worker's entry point: ``python -m asymptote.envs.worker FD SETTINGS_JSON`` (torch-free).

Started by ``asymptote.envs.pool`` with one end of a socket pair as ``FD``;
serves requests on it until it closes (see ``pool.serve``).
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from asymptote.envs.pool import serve


def main(argv: list[str]) -> None:
    fd, settings_json = argv
    serve(Connection(int(fd)), settings_json)


if __name__ == "__main__":
    main(sys.argv[1:])
