"""`python -m bank_service`: settings from the environment (and flags), serve until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from bank_service.config import BankConfig, ConfigError
from bank_service.server import BankService
from kev.serving.settings import log_settings

log = logging.getLogger("bank_service")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = BankConfig.from_env(os.environ, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        log.error("bad settings: %s", e)
        return 2
    log_settings(log, config)
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service = BankService(config)
    try:
        if service.start(stop):
            while not stop.wait(1.0):
                pass
    finally:
        service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
