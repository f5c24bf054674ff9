"""Live ticks that change a chart's layout (the burst shapes, a `Patch` of ``figure``) while new
points arrive (``extendData``), as `dashboard.live`'s tick does while a burst is on: in a real
browser the chart must hold every point once, in order (a duplicated or reordered x draws a
spike), trimmed to ``maxPoints``.

A minimal Dash app with one graph and the dashboard's two outputs drives it. Sending the Patch
and the extendData in one answer loses the new points and re-appends them later, several times
(the first test shows it, so that a Dash upgrade that fixes it is noticed); the dashboard
therefore folds the points into the Patch (`dashboard.figures.fold_extend`), which the second
test checks.
"""

from __future__ import annotations

import threading

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def app_url():
    import dash
    from dash import Input, Output, Patch, dcc, html
    from werkzeug.serving import make_server

    from dashboard import figures as F

    app = dash.Dash(__name__)
    fig = {"data": [{"type": "scatter", "mode": "lines", "x": list(range(10)), "y": [1.0] * 10}],
           "layout": {"shapes": []}}
    state = {"next": 10}

    def layout():  # a fresh page starts from x = 0..9 again
        state["next"] = 10
        return html.Div([dcc.Graph(id="g", figure=fig), html.Button("tick", id="tick"),
                         html.Button("tick+shapes", id="tick-shapes"), html.Button("folded", id="tick-folded")])

    app.layout = layout

    def _ext():
        x = state["next"]
        state["next"] += 1
        return [{"x": [[x]], "y": [[2.0]]}, [0], 15]

    @app.callback(Output("g", "extendData"), Input("tick", "n_clicks"), prevent_initial_call=True)
    def tick(_n):
        return _ext()

    def _shapes(n):
        p = Patch()
        p["layout"]["shapes"] = [{"type": "rect", "name": "burst", "xref": "x", "yref": "paper",
                                  "x0": 0, "x1": n, "y0": 0, "y1": 1}]
        return p

    @app.callback(Output("g", "figure"), Output("g", "extendData", allow_duplicate=True),
                  Input("tick-shapes", "n_clicks"), prevent_initial_call=True)
    def tick_with_shapes(n):  # both in one answer (what the dashboard's tick did)
        return _shapes(n), _ext()

    @app.callback(Output("g", "figure", allow_duplicate=True), Input("tick-folded", "n_clicks"),
                  prevent_initial_call=True)
    def tick_folded(n):  # what the dashboard's tick does
        p = _shapes(n)
        F.fold_extend(p, _ext())
        return p

    server = make_server("127.0.0.1", 0, app.server, threaded=True)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


def _xs(page) -> list:
    return page.evaluate("() => Array.from(document.querySelector('#g .js-plotly-plot').data[0].x)")


def _wait_len(page, want_last: int) -> list:
    page.wait_for_function(
        "(w) => { const d = document.querySelector('#g .js-plotly-plot').data; "
        "return d && d[0].x.length && d[0].x[d[0].x.length - 1] === w; }", arg=want_last, timeout=15_000)
    page.wait_for_timeout(300)  # anything late (a second extend, a redraw) lands meanwhile
    return _xs(page)


def _run(app_url, buttons) -> list[list]:
    """Click ``buttons`` in turn (each adds one point); the trace's x after each click."""
    from playwright.sync_api import sync_playwright

    from bench.dashboard import launch_browser

    seen = []
    with sync_playwright() as p:
        browser = launch_browser(p)
        try:
            page = browser.new_page()
            page.goto(app_url)
            page.wait_for_selector("#g .js-plotly-plot")
            page.wait_for_function("() => document.querySelector('#g .js-plotly-plot').data !== undefined")
            for button in buttons:
                page.click(button)
                page.wait_for_timeout(700)  # the answer, and anything late (a second extend, a redraw)
                seen.append(_xs(page))
            seen.append(page.evaluate("() => document.querySelector('#g .js-plotly-plot').layout.shapes.length"))
        finally:
            browser.close()
    return seen


def test_patch_and_extend_in_one_answer_lose_and_repeat_points(app_url):
    """The defect (Dash 4.4's dcc.Graph), shown: what the dashboard must not send."""
    seen = _run(app_url, ["#tick", "#tick-shapes", "#tick", "#tick"])
    xs = seen[-2]
    assert len(xs) != len(set(xs)) or xs != sorted(xs) or 11 not in seen[1], seen


def test_points_folded_into_the_patch_stay_once_and_in_order(app_url):
    buttons = ["#tick", "#tick", "#tick-folded", "#tick", "#tick-folded", "#tick-folded", "#tick", "#tick",
               "#tick-folded", "#tick", "#tick"]
    seen = _run(app_url, buttons)
    last = 9
    for step, (button, xs) in enumerate(zip(buttons, seen)):
        last += 1
        assert len(xs) == len(set(xs)) and xs == sorted(xs), f"step {step} ({button}): {xs}"
        assert xs[-1] == last, f"step {step} ({button}): the new point is missing: {xs}"
        if button == "#tick":  # a plain extend trims to maxPoints (15)
            assert xs == list(range(max(0, last - 14), last + 1)), f"step {step}: {xs}"
    assert seen[-1] == 1  # the burst shape
