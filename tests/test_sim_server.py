"""The JSON API: same answer as the library, 4xx with a message for bad requests, every request bounded
by the work budget, JSON for the server's own errors, HEAD, a favicon, quiet client disconnects."""

import json
import socket
import struct
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest

from moekit.sim import LIMITS, SimParams, simulate


def _get(url, method="GET"):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=60) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def _connect(base_url) -> socket.socket:
    url = urlsplit(base_url)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def _raw(base_url, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` bytes as they are; return the status, headers (lower-cased names) and body."""
    with _connect(base_url) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, body


def test_binds_loopback_by_default(base_url):
    assert base_url.startswith("http://127.0.0.1:")


def test_defaults_endpoint(base_url):
    status, _, body = _get(base_url + "/api/defaults")
    d = json.loads(body)
    assert status == 200 and d["params"] == SimParams().to_dict()
    assert d["limits"]["skew"] == [0.0, 1.0] and d["balance_methods"] == ["none", "aux-loss", "bias"]
    assert d["budget_s"] == 1.8


def test_simulate_endpoint_is_the_library(base_url):
    status, content_type, body = _get(base_url + "/api/simulate?skew=0.3&balance=bias&bias_batches=30&experts=32")
    assert status == 200 and content_type == "application/json"
    expected = simulate(SimParams(skew=0.3, balance="bias", bias_batches=30, experts=32)).to_dict()
    assert json.loads(body) == json.loads(json.dumps(expected))


@pytest.mark.parametrize("query, message", [
    ("skew=2", "skew must be in [0, 1]"),
    ("experts=many", "experts must be an integer"),
    ("top_k=3&experts=2", "top_k must be <= experts"),
    ("balance=magic", "balance must be one of"),
    ("seed=1&seed=2", "given more than once"),
    ("frobnicate=1", "unknown parameter"),
    ("tokens=", "tokens must be an integer"),
])
def test_bad_parameters_get_400_with_a_message(base_url, query, message):
    status, content_type, body = _get(base_url + "/api/simulate?" + query)
    assert status == 400 and content_type == "application/json"
    assert message in json.loads(body)["error"]


def test_unknown_path_and_method(base_url):
    assert _get(base_url + "/../etc/passwd")[0] == 404
    assert _get(base_url + "/api/simulate", method="POST")[0] == 405


@pytest.mark.parametrize("path, kind", [("/", "text/html"), ("/app.js", "text/javascript"), ("/style.css", "text/css")])
def test_static_page_files(base_url, path, kind):
    status, content_type, body = _get(base_url + path)
    assert status == 200 and content_type.startswith(kind) and len(body) > 500


MAXIMA = {name: int(hi) for name, (lo, hi) in LIMITS.items() if name not in ("capacity_factor", "skew", "seed")}


@pytest.mark.parametrize("balance", ["none", "aux-loss", "bias"])
def test_a_request_at_the_maxima_is_refused_at_once_naming_what_to_lower(base_url, balance):
    # Before the budget these ran 33-75 s and went on after the client left.
    query = "&".join(f"{k}={v}" for k, v in MAXIMA.items()) + f"&balance={balance}"
    start = time.perf_counter()
    status, content_type, body = _get(base_url + "/api/simulate?" + query)
    assert time.perf_counter() - start < 3.0
    answer = json.loads(body)
    assert status == 400 and content_type == "application/json"
    assert "over the work budget" in answer["error"]
    assert (f"lower {answer['parameter']} to at most {answer['max']} (got {MAXIMA[answer['parameter']]})"
            in answer["error"])


@pytest.mark.parametrize("balance, steps", [("aux-loss", "aux_steps"), ("bias", "bias_batches")])
def test_the_largest_run_the_error_allows_answers_within_3_s(base_url, balance, steps):
    query = f"experts=256&top_k=2&tokens=1024&spare_slots=0&skew=0&balance={balance}&{steps}={MAXIMA[steps]}"
    status, _, body = _get(base_url + "/api/simulate?" + query)
    refusal = json.loads(body)
    assert status == 400 and refusal["parameter"] == steps and 0 < refusal["max"] < MAXIMA[steps]
    start = time.perf_counter()
    status, _, body = _get(base_url + "/api/simulate?"
                           + query.replace(f"{steps}={MAXIMA[steps]}", f"{steps}={refusal['max']}"))
    assert time.perf_counter() - start < 3.0
    assert status == 200 and json.loads(body)["balance"]["steps"] == refusal["max"]


def test_head_is_get_without_the_body(base_url):
    for path in ("/", "/api/defaults", "/favicon.ico", "/nowhere"):
        status, headers, body = _raw(base_url, f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        get_status, _, get_body = _get(base_url + path)
        assert (status, body) == (get_status, b"") and int(headers["content-length"]) == len(get_body)


def test_favicon(base_url):
    status, content_type, body = _get(base_url + "/favicon.ico")
    assert status == 200 and content_type == "image/svg+xml" and body.startswith(b"<svg")
    assert b'href="favicon.svg"' in _get(base_url + "/")[2]


@pytest.mark.parametrize("request_bytes, status, message", [
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414, "414 Request-URI Too Long"),
    (b"GET / HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", 431, "431 Line too long"),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431, "431 Too many headers"),
], ids=["uri-too-long", "header-line-too-long", "too-many-headers"])
def test_the_servers_own_errors_are_json(base_url, request_bytes, status, message):
    got, headers, body = _raw(base_url, request_bytes)
    assert got == status and headers["content-type"] == "application/json"
    assert json.loads(body)["error"].startswith(message)


def test_a_client_that_hangs_up_costs_one_quiet_line(base_url, capsys):
    with _connect(base_url) as sock:
        sock.sendall(b"GET /api/simulate?balance=bias&bias_batches=150 HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.05)  # the server has read the request and is simulating
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    err = ""
    deadline = time.monotonic() + 20
    while "went away" not in err and time.monotonic() < deadline:
        time.sleep(0.05)
        err += capsys.readouterr().err
    time.sleep(0.2)
    err += capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1 and "moekit-sim: client 127.0.0.1:" in err and "went away" in err
