"""Monitoring polls stay out of the access log: `hivejet top`, the desktop app's Monitor and Prometheus
read GET /health, /slots and /metrics several times a second, which would bury the requests that matter.
Answered polls (2xx/3xx) are dropped from uvicorn's access log; failed ones stay, as does everything at
--log-level debug."""
from __future__ import annotations

import logging

POLL_PATHS = frozenset({"/health", "/slots", "/metrics"})


class QuietPolls(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 5:     # (client, method, path, http version, status)
            return True
        _client, method, path, _version, status = args[:5]
        path = str(path).split("?", 1)[0]
        try:
            ok = 200 <= int(status) < 400
        except (TypeError, ValueError):
            return True
        return not (method == "GET" and path in POLL_PATHS and ok)


def quiet_polls(log_level: str) -> None:
    """Install the filter on uvicorn's access logger unless the level is debug."""
    if log_level != "debug":
        logger = logging.getLogger("uvicorn.access")
        if not any(isinstance(f, QuietPolls) for f in logger.filters):
            logger.addFilter(QuietPolls())
