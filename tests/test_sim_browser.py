"""The simulator page in a real browser: Debian's Chromium, headless, driven by Playwright.

It opens the page, reads the lesson's defaults, moves the skew slider with the keyboard, toggles
balancing, and after each step checks that what the page shows equals the API's answer for the
settings the page sent. A screenshot goes to test-artifacts/. Playwright never downloads a browser
here: it launches the system ``chromium``; the test skips only when that binary is missing.
"""

import json
import shutil
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs

import pytest
from playwright.sync_api import sync_playwright

from moekit.sim.report import format_params

CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

pytestmark = pytest.mark.skipif(CHROMIUM is None,
                                reason="Debian's chromium is not installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def page(base_url):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1200, "height": 1500})
        pg.set_default_timeout(60_000)  # aux-loss training on a loaded 2-core CI box
        pg.goto(base_url + "/")
        yield pg
        browser.close()


def _wait_rendered(page, **expected) -> tuple[str, dict[str, str]]:
    """Wait until the page has rendered an answer for settings that include ``expected``; return the
    query it sent and that query parsed."""
    page.wait_for_function(
        """(expected) => {
             const app = document.getElementById('app');
             if (app.dataset.state !== 'ready' || !app.dataset.query) return false;
             const q = new URLSearchParams(app.dataset.query);
             return Object.entries(expected).every(([k, v]) => Number.isNaN(Number(v)) ? q.get(k) === v
                                                                                      : Number(q.get(k)) === Number(v));
           }""",
        arg={k: str(v) for k, v in expected.items()},
    )
    query = page.get_attribute("#app", "data-query")
    return query, {k: v[0] for k, v in parse_qs(query).items()}


def _api(base_url, query) -> dict:
    with urllib.request.urlopen(f"{base_url}/api/simulate?{query}", timeout=120) as r:
        return json.load(r)


def _number(text: str) -> float:
    return float(text.replace("µs", "").replace("×", "").replace("%", "").strip())


def _check_page_shows(page, api: dict) -> None:
    text = page.text_content
    assert text("#total-params") == format_params(api["total_params"])
    assert text("#active-params") == format_params(api["active_params"])
    assert _number(text("#sparsity")) == pytest.approx(api["sparsity"], abs=0.051)
    dropped, rate = text("#dropped").split(" ")  # "195 (76.2%)"; compared as numbers: JS and Python round ties apart
    assert (int(dropped) == api["dropped"]
            and _number(rate.strip("()")) == pytest.approx(100 * api["drop_rate"], abs=0.051))
    assert _number(text("#imbalance")) == pytest.approx(api["imbalance"], abs=0.0051)
    assert text("#experts-touched") == f"{api['experts_touched']} of {api['params']['experts']}"
    assert text("#capacity") == str(api["capacity"])
    bars = page.eval_on_selector_all(
        "#hist rect.bar-kept", "els => els.map(e => [Number(e.dataset.load), Number(e.dataset.kept)])")
    assert [load for load, _ in bars] == api["loads"]
    assert [kept for _, kept in bars] == api["kept"]
    assert page.locator("#hist rect.bar-over").count() == sum(1 for l, k in zip(api["loads"], api["kept"]) if l > k)
    for t in api["touched_by_batch"]:
        cells = page.locator(f"#touched tr[data-batch='{t['batch']}'] td").all_text_contents()
        assert _number(cells[1]) == pytest.approx(t["simulated"], abs=0.051)
        assert _number(cells[2]) == pytest.approx(t["predicted"], abs=0.051)
    for pl in api["ep"]["placements"]:
        cells = page.locator(f"#ep tr[data-placement='{pl['name']}'] td").all_text_contents()
        assert _number(cells[1]) == pytest.approx(pl["step_time_us"], abs=0.0051)
        assert _number(cells[3]) == pytest.approx(pl["imbalance"], abs=0.0051)
        assert _number(cells[4]) == pytest.approx(100 * pl["throughput_lost"], abs=0.051)


def test_page_defaults_slider_and_balancing_match_the_api(page, base_url):
    # 1. The lesson's defaults, as the page shows them and sends them.
    query, sent = _wait_rendered(page, skew=0.55, balance="none")
    assert {k: sent[k] for k in ("experts", "top_k", "tokens", "capacity_factor", "skew", "seed", "balance")} == {
        "experts": "64", "top_k": "2", "tokens": "128", "capacity_factor": "1.25", "skew": "0.55", "seed": "5",
        "balance": "none"}
    assert page.text_content("#skew-value") == "0.55" and not page.is_checked("#balance-toggle")
    default = _api(base_url, query)
    _check_page_shows(page, default)

    # 2. Move the skew slider the way a user does: focus it and press the right arrow 35 steps (0.01 each).
    page.focus("#skew")
    for _ in range(35):
        page.keyboard.press("ArrowRight")
    query, _ = _wait_rendered(page, skew=0.9, balance="none")
    assert page.text_content("#skew-value") == "0.90"
    skewed = _api(base_url, query)
    _check_page_shows(page, skewed)
    assert skewed["imbalance"] > default["imbalance"]

    # 3. Toggle balancing (the auxiliary loss is the default method).
    page.click("#balance-toggle")
    query, _ = _wait_rendered(page, skew=0.9, balance="aux-loss")
    balanced = _api(base_url, query)
    _check_page_shows(page, balanced)
    b = balanced["balance"]
    assert b["imbalance_after"] < b["imbalance_before"]
    assert f"{b['imbalance_before']:.2f}× → {b['imbalance_after']:.2f}×" in page.text_content("#balance-report")

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "sim_page.png"), full_page=True)


def test_bad_setting_shows_the_servers_message(page):
    page.fill("#gpus", "1000")  # more GPUs than experts
    page.wait_for_function("document.getElementById('app').dataset.state === 'error'")
    assert "gpus must be" in page.text_content("#status")
    # the numbers still shown are the last good answer's: dimmed while the error stands
    assert float(page.eval_on_selector(".stats", "el => getComputedStyle(el).opacity")) < 0.5


@pytest.fixture
def fresh_page(page):
    context = page.context.browser.new_context(viewport={"width": 1200, "height": 1500})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    yield pg
    context.close()


def test_settings_live_in_the_address_and_survive_a_reload(fresh_page, base_url):
    pg = fresh_page
    pg.goto(base_url + "/?experts=32&top_k=4&skew=0.3&balance=bias&bias_batches=50")
    _wait_rendered(pg, experts=32, top_k=4, skew=0.3, balance="bias", bias_batches=50)
    assert pg.is_checked("#balance-toggle") and pg.input_value("#balance-method") == "bias"
    pg.focus("#skew")
    for _ in range(5):
        pg.keyboard.press("ArrowRight")
    _wait_rendered(pg, skew=0.35, experts=32)
    assert "skew=0.35" in pg.url
    pg.reload()
    query, _ = _wait_rendered(pg, experts=32, top_k=4, skew=0.35, balance="bias", bias_batches=50)
    assert pg.text_content("#skew-value") == "0.35" and pg.input_value("#bias_batches") == "50"
    _check_page_shows(pg, _api(base_url, query))


def test_histogram_has_a_y_axis_and_tooltips(fresh_page, base_url):
    pg = fresh_page
    pg.goto(base_url + "/?experts=16&tokens=256")
    query, _ = _wait_rendered(pg, experts=16, tokens=256)
    api = _api(base_url, query)
    ticks = pg.eval_on_selector_all("#hist .y-axis text.tick",
                                    "els => els.map(e => [Number(e.dataset.value), e.textContent, "
                                    "Number(e.getAttribute('y'))])")
    values = [v for v, _, _ in ticks]
    assert len(values) >= 3 and values[0] == 0 and [label for _, label, _ in ticks] == [f"{v:g}" for v in values]
    steps = {b - a for a, b in zip(values, values[1:])}
    assert len(steps) == 1 and str(steps.pop())[0] in "125"  # evenly spaced, 1, 2 or 5 times a power of ten
    assert max(api["loads"]) / 2 <= values[-1] <= 1.1 * max(max(api["loads"]), api["capacity"])
    assert [y for _, _, y in ticks] == sorted((y for _, _, y in ticks), reverse=True)  # larger values higher up
    assert pg.text_content("#hist .y-axis .axis-name") == "assignments"
    tips = pg.eval_on_selector_all("#hist g.expert > title", "els => els.map(e => e.textContent)")
    for e, (tip, load, kept) in enumerate(zip(tips, api["loads"], api["kept"])):
        dropped = f", {load - kept} dropped" if load > kept else ""
        assert tip == f"expert {e}: {load} assignments, {kept} processed{dropped}"
