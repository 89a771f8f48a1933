"""The JSON API: same answer as the library, 4xx with a message for bad requests."""

import json
import urllib.error
import urllib.request

import pytest

from moekit.sim import SimParams, simulate


def _get(url, method="GET"):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=60) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_binds_loopback_by_default(base_url):
    assert base_url.startswith("http://127.0.0.1:")


def test_defaults_endpoint(base_url):
    status, _, body = _get(base_url + "/api/defaults")
    d = json.loads(body)
    assert status == 200 and d["params"] == SimParams().to_dict()
    assert d["limits"]["skew"] == [0.0, 1.0] and d["balance_methods"] == ["none", "aux-loss", "bias"]


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
