"""Helpers the benchmarks share: a free loopback port and waiting for an HTTP endpoint.

Every benchmark runs as `python3 bench/NAME.py`, so this directory is first on sys.path and
`from common import ...` finds this file.
"""
import http.client
import json
import os
import platform
import socket
import time
import urllib.parse
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 180.0, proc=None, log=None) -> tuple[float, str]:
    """Poll GET `url` until it answers 200; return (seconds waited, body).

    With `proc` (a subprocess.Popen), stop at once if it exits; `log` (a path) is quoted in
    the error so a server that failed to start says why. Raises SystemExit on timeout."""
    u = urllib.parse.urlsplit(url)
    tail = lambda: f":\n{Path(log).read_text(errors='replace')[-3000:]}" if log else ""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited early{tail()}")
        try:
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=2)
            c.request("GET", u.path or "/")
            r = c.getresponse()
            body = r.read().decode(errors="replace")
            c.close()
            if r.status == 200:
                return time.monotonic() - t0, body
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} did not answer 200 within {timeout} s{tail()}")


def write_report(out: str, report: dict, machine_note: str) -> None:
    """Write a benchmark's JSON to `out` with the machine it ran on, and say so."""
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "note": machine_note}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
