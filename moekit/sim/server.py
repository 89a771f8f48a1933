"""The simulator's local web page and its JSON API, on the standard library's ``http.server``.

    GET /                 the page (moekit/sim/web/index.html, app.js, style.css, favicon.svg)
    GET /api/defaults     {"params": SimParams defaults, "limits": {name: [min, max]}, "balance_methods": [...],
                           "budget_s": the work budget}
    GET /api/simulate?experts=64&top_k=2&...   SimResult.to_dict(); any SimParams field may be given
    bad parameters -> 400 {"error": message}; a run over the work budget -> 400 {"error": message,
    "parameter": name, "max": the largest value of it that fits}; unknown path -> 404; other methods
    -> 405; every error the server itself answers (414, 431, ...) is JSON too. HEAD works wherever GET does.

The work budget (``moekit.sim.budget``) bounds each request: a run predicted to take more than about
1.5 s of one core is refused before it starts, so no request runs on long after its client has left.
A client that disconnects early costs one line on stderr, not a traceback.

Binds to 127.0.0.1 by default: the page is a local tool, not a service. No simulation logic lives here
or in the page; both ask ``moekit.sim.simulate``.

Served with a model (``make_server(model=...)``, ``moekit serve --preset / --config``), every run routes with its
layer's router: experts and top_k are the model's (the defaults say so, with "model" and "router"; a request naming
other values gets 400 naming the parameter), the rest as above.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from moekit.analysis.billed import billed_layer
from moekit.sim.balance import warm_up
from moekit.sim.budget import BUDGET_S, OverBudgetError, check_budget
from moekit.config import MoEConfig
from moekit.sim.params import BALANCE_METHODS, LIMITS, SimParams
from moekit.sim.run import router_summary, simulate

WEB_DIR = Path(__file__).with_name("web")
SVG = "image/svg+xml"
STATIC = {  # the only files served: no path from the URL ever reaches the filesystem
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", SVG),
    "/favicon.ico": ("favicon.svg", SVG),  # browsers ask for this one unasked; every browser draws SVG icons
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
            self._json(200, self.server.defaults())
        elif url.path == "/api/simulate":
            self._simulate(url.query)
        else:
            self._json(404, {"error": f"no such path: {url.path}"})

    do_HEAD = do_GET  # the same status and headers; ``_send`` leaves the body out

    def _simulate(self, query: str) -> None:
        values = parse_qs(query, keep_blank_values=True)
        repeated = sorted(k for k, v in values.items() if len(v) > 1)
        try:
            if repeated:
                raise ValueError(f"parameter(s) given more than once: {', '.join(repeated)}")
            params = SimParams.from_strings(self.server.with_model({k: v[0] for k, v in values.items()}))
            check_budget(params, None if self.server.model is None else self.server.model.router_width)
        except OverBudgetError as e:
            self._json(400, {"error": str(e), "parameter": e.parameter, "max": e.largest})
            return
        except ModelFixedError as e:
            self._json(400, {"error": str(e), "parameter": e.parameter})
            return
        except ValueError as e:
            self._json(400, {"error": str(e)})
            return
        try:
            self._json(200, simulate(params, self.server.model_fields or self.server.model).to_dict())
        except Exception as e:  # a bug must answer, not drop the connection; the message says what broke
            self._json(500, {"error": f"internal error: {type(e).__name__}: {e}"})

    def _method_not_allowed(self) -> None:
        self._json(405, {"error": f"method {self.command} not allowed; use GET or HEAD"}, {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (400 bad request line, 414 URI too long, 431 headers too large, 501
        unknown method) as JSON like the API's, instead of its HTML page; the connection then closes."""
        short, long = self.responses.get(code, ("error", ""))
        self.log_error("code %d, message %s", code, message or short)
        self.close_connection = True
        text = f"{code} {message or short}: {explain or long}"
        self._json(code, {"error": text}, {"Connection": "close"})

    def _json(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json", headers)

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)


class ModelFixedError(ValueError):
    """A request naming experts or top_k other than the served model's."""

    def __init__(self, parameter: str, value: str, model: str, fixed: int) -> None:
        super().__init__(f"{parameter} is {fixed}, fixed by the served model {model}; got {value!r}")
        self.parameter = parameter


class SimServer(ThreadingHTTPServer):
    """One thread per request; a client that hangs up early is one line on stderr, not a traceback."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], verbose: bool = False, model: MoEConfig | None = None,
                 model_name: str = "", model_fields: dict | None = None) -> None:
        super().__init__(address, SimRequestHandler)
        self.verbose = verbose  # log every request
        self.model = model  # every run routes with this layer's router; None: the default softmax top-k
        self.model_name = model_name
        self.model_fields = model_fields  # model's config.json fields: runs price that model (simulate's dict)

    def fixed(self) -> dict[str, int]:
        """The parameters the served model fixes (experts, top_k); none without a model."""
        return {} if self.model is None else {"experts": self.model.num_experts, "top_k": self.model.top_k}

    def with_model(self, values: dict[str, str]) -> dict[str, str]:
        """The query's values with the model's experts and top_k filled in; another value of either is refused."""
        for name, fixed in self.fixed().items():
            if name in values and values[name] != str(fixed):
                raise ModelFixedError(name, values[name], self.model_name, fixed)
        return values | {name: str(fixed) for name, fixed in self.fixed().items()}

    def defaults(self) -> dict:
        """/api/defaults: the page's settings (the model's E and k, as many GPUs and spare slots as fit), the
        limits (E and k pinned with a model), the balancing methods, the work budget, the model's router, and the
        note of a model moekit cannot serve (``BilledLayer.note``: the numbers its runs route instead)."""
        params, limits = SimParams().to_dict(), dict(LIMITS)
        if self.model is not None:
            e = self.model.num_experts
            gpus = min(params["gpus"], e)
            params |= self.fixed() | {"gpus": gpus, "spare_slots": min(params["spare_slots"], e * (gpus - 1))}
            limits |= {name: (fixed, fixed) for name, fixed in self.fixed().items()}
        router = None if self.model is None else router_summary(self.model)
        note = None if self.model_fields is None else billed_layer(self.model_fields).note
        return {"params": params, "limits": limits, "balance_methods": list(BALANCE_METHODS), "budget_s": BUDGET_S,
                "model": self.model_name or None, "router": router, "note": note}

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, ConnectionError):  # BrokenPipe, ConnectionReset, ConnectionAborted
            super().handle_error(request, client_address)
            return
        host, port = client_address[:2]
        print(f"moekit-sim: client {host}:{port} went away before the answer was sent ({type(error).__name__})",
              file=sys.stderr, flush=True)


def make_server(host: str = "127.0.0.1", port: int = 0, verbose: bool = False, model: MoEConfig | None = None,
                model_name: str = "", model_fields: dict | None = None) -> SimServer:
    """A server bound to ``host:port`` (port 0 picks a free one: read ``server.server_address``), warmed
    up so that no request pays a one-time import; every run routes with ``model``'s router when given, and prices
    the whole model of ``model_fields`` (its config.json's, which ``model`` was read from) when given."""
    warm_up()
    return SimServer((host, port), verbose, model, model_name or ("" if model is None else "(a MoEConfig)"),
                     model_fields)
