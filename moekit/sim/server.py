"""The simulator's local web page and its JSON API, on the standard library's ``http.server``.

    GET /                 the page (moekit/sim/web/index.html, app.js, style.css)
    GET /api/defaults     {"params": SimParams defaults, "limits": {name: [min, max]}, "balance_methods": [...]}
    GET /api/simulate?experts=64&top_k=2&...   SimResult.to_dict(); any SimParams field may be given
    bad parameters -> 400 {"error": message}; unknown path -> 404; other methods -> 405

Binds to 127.0.0.1 by default: the page is a local tool, not a service. No simulation logic lives here
or in the page; both ask ``moekit.sim.simulate``.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from moekit.sim.params import BALANCE_METHODS, LIMITS, SimParams
from moekit.sim.run import simulate

WEB_DIR = Path(__file__).with_name("web")
STATIC = {  # the only files served: no path from the URL ever reaches the filesystem
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}


class SimRequestHandler(BaseHTTPRequestHandler):
    """Serves the static page and the two API endpoints; quiet unless ``server.verbose``."""

    server_version = "moekit-sim"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        url = urlsplit(self.path)
        if url.path in STATIC:
            name, content_type = STATIC[url.path]
            self._send(200, (WEB_DIR / name).read_bytes(), content_type)
        elif url.path == "/api/defaults":
            self._json(200, {"params": SimParams().to_dict(), "limits": LIMITS, "balance_methods": list(BALANCE_METHODS)})
        elif url.path == "/api/simulate":
            self._simulate(url.query)
        else:
            self._json(404, {"error": f"no such path: {url.path}"})

    def _simulate(self, query: str) -> None:
        values = parse_qs(query, keep_blank_values=True)
        repeated = sorted(k for k, v in values.items() if len(v) > 1)
        try:
            if repeated:
                raise ValueError(f"parameter(s) given more than once: {', '.join(repeated)}")
            params = SimParams.from_strings({k: v[0] for k, v in values.items()})
        except ValueError as e:
            self._json(400, {"error": str(e)})
            return
        try:
            self._json(200, simulate(params).to_dict())
        except Exception as e:  # a bug must answer, not drop the connection; the message says what broke
            self._json(500, {"error": f"internal error: {type(e).__name__}: {e}"})

    def _method_not_allowed(self) -> None:
        self._json(405, {"error": f"method {self.command} not allowed; use GET"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _method_not_allowed

    def _json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)


def make_server(host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> ThreadingHTTPServer:
    """A server bound to ``host:port`` (port 0 picks a free one: read ``server.server_address``)."""
    server = ThreadingHTTPServer((host, port), SimRequestHandler)
    server.daemon_threads = True
    server.verbose = verbose
    return server
