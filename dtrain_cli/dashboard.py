"""``dtrain dashboard RUN_DIR``: the dashboard of a run whose coordinator has finished or is gone, served from the
run's files (:mod:`coordinator.run_view`) until Ctrl-C."""

from __future__ import annotations

import signal
import threading
from pathlib import Path


def main(run_dir: str, host: str, port: int) -> int:
    from coordinator.run_view import serve_run

    dash = serve_run(Path(run_dir), host, port)
    print(f"dashboard of {run_dir} (from its files) at {dash.url}; Ctrl-C stops it", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        dash.close()
    return 0
