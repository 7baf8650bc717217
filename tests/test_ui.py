"""The page at ``/ui`` of a real ``inferscale serve`` (vLLM's server, SmolLM2, Chroma on disk),
driven in Debian's Chromium by Playwright (issue 41).

One server for the module: a user with memories (two of them XSS payloads), chats in inject
mode (streamed and whole) and in text mode. The browser loads the page, connects with the key,
lists the scopes, opens one, searches, edits and deletes a memory (checked through the REST
API), opens chat reports (KV against text per memory) and the pool; the payloads render as
text and run nothing; without the key every data route is 401. Each view's screenshot is
written to docs/img/ui/ (the docs show them).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from tests.test_server import KEY, start_server

pytestmark = pytest.mark.slow

SHOTS = Path(__file__).resolve().parents[1] / "docs" / "img" / "ui"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: memory texts and metadata that would run script if the page wrote them as markup
XSS_TEXT = ['Ada keeps a note: <script>window.__xss = "script"</script>',
            'Ada\'s avatar is <img src=x onerror="window.__xss = \'onerror\'">']
XSS_META = {"label": '<svg onload="window.__xss = \'svg\'"></svg>', "link": '"><a href=javascript:alert(1)>x</a>'}
FACTS = ["Ada's cat is called Pixel.", "Ada works as a lighthouse keeper.", "Ada drinks rooibos tea every morning."]
USER = "ada"
SCOPE = f"#scopes button[data-scope='user_id=\"{USER}\"']"  # the page quotes each scope id as JSON does


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("ui") / "data")
    r = s.http("POST", "/memories", json={"messages": [{"role": "user", "content": f} for f in FACTS], "user_id": USER})
    assert r.status_code == 200, r.text
    s.ids = {e["memory"]: e["id"] for e in r.json()["results"]}
    for text in XSS_TEXT:
        r = s.http("POST", "/memories", json={"messages": text, "user_id": USER, "metadata": XSS_META})
        assert r.status_code == 200, r.text
        s.ids[text] = r.json()["results"][0]["id"]
    r = s.http("POST", "/memories", json={"messages": "Bob flies gliders.", "user_id": "bob"})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 300  # every memory's KV encoded: the chats below inject it
    while not all(m["kv"] for m in memories(s)):
        assert time.monotonic() < deadline, memories(s)
        time.sleep(1)
    client = s.client()
    model = client.models.list().data[0].id
    ask = {"model": model, "user": USER, "max_tokens": 12, "temperature": 0}
    client.chat.completions.create(messages=[{"role": "user", "content": "What is my cat called?"}], **ask)
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "Where do I work?"}], stream=True,
                                            stream_options={"include_usage": True}, **ask)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    client.chat.completions.create(messages=[{"role": "user", "content": "What do I drink?"}],
                                   extra_body={"memory": {"mode": "text"}}, **ask)
    yield s
    s.proc.terminate()
    assert s.proc.wait(60) == 0, s.log.read_text()[-3000:]


def memories(s) -> list[dict]:
    r = s.http("GET", f"/ui/api/memories?user_id={USER}")
    assert r.status_code == 200, r.text
    return r.json()["results"]


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM, "Chromium is missing: scripts/install.sh installs Debian's chromium package"

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(served, browser):
    # the page's CSP off: escaping alone must keep the payloads inert (and Playwright's waits evaluate strings)
    context = browser.new_context(viewport={"width": 1366, "height": 860}, bypass_csp=True)
    pg = context.new_page()
    pg.dialogs, pg.errors = [], []
    pg.accept_dialogs = True
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.accept() if pg.accept_dialogs else d.dismiss()))
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.goto(served.url + "/ui")
    yield pg
    assert context.cookies() == []  # no cookie-borne credential, ever
    context.close()


def connect(pg) -> None:
    pg.fill("#key", KEY)
    pg.click("#connect")
    pg.wait_for_selector(SCOPE)


def open_scope(pg) -> None:
    connect(pg)
    pg.click(SCOPE)
    pg.wait_for_selector("#memories tbody tr")


def shot(pg, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_without_the_key_the_page_loads_empty_and_every_data_route_is_401(served, page):
    page.wait_for_selector("#status:has-text('this server needs its API key')")  # the page asked, and was told
    assert page.is_visible("#welcome-key") and not page.is_visible("#welcome-connected")
    assert page.locator("#scopes li").count() == 0
    r = httpx.get(served.url + "/ui")
    assert r.status_code == 200 and "connect-src 'self'" in r.headers["content-security-policy"]
    assert "script-src 'self'" in r.headers["content-security-policy"] and "set-cookie" not in r.headers
    for path in ("/ui/api/scopes", f"/ui/api/memories?user_id={USER}", f"/ui/api/chats?user_id={USER}",
                 "/ui/api/pool", "/ui/api/pool.svg", f"/memories?user_id={USER}"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert httpx.get(served.url + path, headers=headers).status_code == 401, path


def test_the_pages_files_take_no_parameters_so_no_client_shapes_what_they_serve(served):
    for path in ("/ui", "/ui/app.js", "/ui/style.css"):
        page = httpx.get(served.url + path)
        for query in ("?body=<script>alert(1)</script>&media_type=text/html", "?media_type=text/html%0D%0AX:1",
                      "?x=1"):
            r = httpx.get(served.url + path + query)
            assert r.status_code == 400 and "<script>" not in r.text, (path, query, r.text)
        assert httpx.get(served.url + path).content == page.content  # and serving goes on, unchanged


def test_scopes_list_with_counts_and_a_scope_shows_its_memories_and_their_kv(page):
    connect(page)
    assert page.inner_text(SCOPE).split()[-1] == str(len(FACTS) + 2)
    assert page.locator("#scopes button[data-scope='user_id=\"bob\"']").count() == 1
    page.click(SCOPE)
    page.wait_for_selector("#memories tbody tr")
    rows = page.locator("#memories tbody tr")
    assert rows.count() == len(FACTS) + 2
    table = page.inner_text("#memories")
    for fact in FACTS:
        assert fact in table
    assert "encoded (w=5)" in table and "disk" in table and "tokens" in table  # each memory's KV
    shot(page, "memories")


def test_xss_payloads_render_as_text_and_run_nothing(page):
    open_scope(page)
    table = page.inner_text("#memories")
    for text in XSS_TEXT:
        assert text in table  # shown as the characters it is
    assert all(json.dumps(v) in table for v in XSS_META.values())  # the metadata, as JSON text
    assert page.locator("#memories script, #memories img, #memories svg, #memories a").count() == 0
    page.click("#tab-chats")
    page.wait_for_selector("#chats tbody tr")
    page.click("#chats tbody tr >> nth=-1 >> button.open")
    page.click("#show-pool")
    page.wait_for_function("document.getElementById('pool-plot').naturalWidth > 0")
    assert page.evaluate("window.__xss") is None and page.dialogs == [] and page.errors == []


def test_search_shows_the_hybrid_ranking_with_scores(served, page):
    open_scope(page)
    page.click("#tab-search")
    page.fill("#search-input", "what is the cat called")
    page.click("#search-go")
    page.wait_for_selector("#search-results tbody tr")
    first = page.locator("#search-results tbody tr").first
    assert first.get_attribute("data-id") == served.http("POST", "/search", json={
        "user_id": USER, "query": "what is the cat called", "mode": "hybrid"}).json()["results"][0]["id"]
    cells = first.locator("td").all_inner_texts()
    assert cells[0] == "1" and "Pixel" in cells[1] and -1 <= float(cells[2]) <= 1 and cells[3].isdigit()
    shot(page, "search")


def test_edit_and_delete_go_through_the_rest_api_after_confirmation(served, page):
    open_scope(page)
    target = served.ids["Ada works as a lighthouse keeper."]
    row = page.locator(f'#memories tbody tr[data-id="{target}"]')
    row.locator("button.edit").click()
    page.fill(f'#memories tbody tr[data-id="{target}"] textarea', "Ada works as a harbour pilot.")
    page.accept_dialogs = False  # refused: nothing changes
    page.click(f'#memories tbody tr[data-id="{target}"] button.save')
    assert served.http("GET", f"/memories/{target}?user_id={USER}").json()["memory"] == FACTS[1]
    page.accept_dialogs = True
    page.click(f'#memories tbody tr[data-id="{target}"] button.save')
    page.wait_for_function(f"""document.querySelector('#memories tr[data-id="{target}"] td').textContent
                               .includes('harbour pilot')""")
    assert served.http("GET", f"/memories/{target}?user_id={USER}").json()["memory"] == "Ada works as a harbour pilot."
    page.click(f'#memories tbody tr[data-id="{target}"] button.history')
    page.wait_for_selector("#memories tr.history")
    history = page.inner_text("#memories tr.history")
    assert "ADD" in history and "UPDATE" in history and "harbour pilot" in history

    doomed = served.ids[XSS_TEXT[1]]
    n = page.locator("#memories tbody tr[data-id]").count()
    page.click(f'#memories tbody tr[data-id="{doomed}"] button.delete')
    page.wait_for_function(f"document.querySelectorAll('#memories tbody tr[data-id]').length === {n - 1}")
    assert served.http("GET", f"/memories/{doomed}?user_id={USER}").status_code == 404
    assert len(page.dialogs) == 3 and "Delete this memory?" in page.dialogs[-1]
    expect(page.locator(SCOPE).locator(".count")).to_have_text(str(len(FACTS) + 1))  # the scope list reloaded


def test_a_chats_report_shows_which_memories_came_as_kv_and_which_as_text(served, page):
    open_scope(page)
    page.click("#tab-chats")
    page.wait_for_selector("#chats tbody tr")
    rows = page.locator("#chats tbody tr")
    assert rows.count() == 3  # newest first: text mode, streamed, whole
    texts = rows.all_inner_texts()
    assert "What do I drink?" in texts[0] and "text" in texts[0]
    assert "Where do I work?" in texts[1] and " ms" in texts[1].split("\t")[4]  # a streamed chat's TTFT
    rows.nth(2).locator("button.open").click()
    report = page.locator("#chat-report")
    assert "What is my cat called?" in report.inner_text()
    kinds = report.locator("tbody tr td:nth-child(3)").all_inner_texts()
    sources = report.locator("tbody tr td:nth-child(4)").all_inner_texts()
    assert kinds and set(kinds) == {"KV"}, kinds
    assert set(sources) <= {"device", "disk", "host"}, sources
    assert report.locator(".bar .kv-part").count() == 1  # the prompt's layout: injected, then prefilled
    chats = served.http("GET", f"/ui/api/chats?user_id={USER}").json()["results"]
    whole = chats[2]
    assert whole["injected_tokens"] == whole["kv_tokens"] > 0 and whole["prefilled_tokens"] < whole["prompt_tokens"]
    shot(page, "chat-report")
    rows.nth(0).locator("button.open").click()
    kinds = report.locator("tbody tr td:nth-child(3)").all_inner_texts()
    assert kinds and set(kinds) == {"text"}
    assert chats[0]["kv_tokens"] == 0 and chats[0]["prefilled_tokens"] > whole["prefilled_tokens"]  # memories too


def test_connected_the_welcome_says_to_pick_a_scope_and_a_wrong_key_asks_again(page):
    connect(page)
    expect(page.locator("#welcome-connected")).to_be_visible()  # not "enter the key" once connected
    assert not page.is_visible("#welcome-key")
    page.fill("#key", "wrong")
    page.click("#connect")
    page.wait_for_selector("#status:has-text('refused this API key')")
    assert page.is_visible("#welcome-key") and not page.is_visible("#welcome-connected")


def test_the_pool_shows_bytes_against_budgets_and_a_plot_never_a_broken_image(page):
    connect(page)
    # every animation frame from the click on: the plot is hidden until it has loaded, never broken
    page.evaluate("""() => { window.__broken = 0; window.__stop = false;
        const img = document.getElementById('pool-plot');
        const check = () => { if (!img.hidden && !(img.complete && img.naturalWidth > 0)) window.__broken++;
                              if (!window.__stop) requestAnimationFrame(check); };
        requestAnimationFrame(check); }""")
    page.click("#show-pool")
    page.wait_for_function("document.getElementById('pool-plot').naturalWidth > 0 && "
                           "!document.getElementById('pool-plot').hidden")
    assert page.evaluate("() => { window.__stop = true; return window.__broken; }") == 0
    assert not page.is_visible("#pool-plot-wait")
    tiers = page.inner_text("#pool-tiers")
    assert "disk" in tiers and "no limit" in tiers  # the disk tier has no budget here
    served = page.inner_text("#pool-served")
    assert "Since this worker started, in the chats of every scope" in served and "Chats tab" in served
    shot(page, "pool")


def test_the_favicon_is_served_without_the_key(served, page):
    for path in ("/favicon.ico", "/ui/favicon.svg"):
        r = httpx.get(served.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml"), path
        assert r.content.startswith(b"<svg")
    icon = page.evaluate("() => document.querySelector(\"link[rel='icon']\").href")
    assert icon.endswith("/ui/favicon.svg")


def test_the_pool_plot_shows_equal_tiers_and_an_evictions_axis_from_zero():
    """Every memory on the device and on disk (equal lines): the device line is drawn over the
    disk line and thinner, so both show; with no evictions the axis starts at 0 with whole
    numbers and says so."""
    from inferscale.server.pool_history import PoolHistory

    stats = {"device_bytes": 0, "disk_bytes": 0}
    history = PoolHistory(lambda: dict(stats), {"device": None, "host": None, "disk": None})
    for n in range(4):
        stats.update(device_bytes=n * 2**20, disk_bytes=n * 2**20)
        history.sample()
    held, _, evicted = history.figure(history.samples()).axes
    lines = {line.get_label(): line for line in held.get_lines()}
    assert lines["device"].get_zorder() > lines["disk"].get_zorder()
    assert lines["device"].get_linewidth() < lines["disk"].get_linewidth()
    assert evicted.get_ylim()[0] == 0 and all(float(t).is_integer() for t in evicted.get_yticks())
    assert "no evictions" in [t.get_text() for t in evicted.texts]
    assert b"no evictions" in history.plot_svg()


def test_a_scope_id_that_is_not_ascii_shows_its_code_points(served, page):
    """Issue 52: ids of one script may still look like ids of another (Cyrillic 'аре', Latin
    'ape'); the page tells them apart by their code points (mixed-script ids are refused)."""
    for user in ("\u0430\u0440\u0435", "ape"):
        r = served.http("POST", "/memories", json={"messages": "Likes bananas.", "user_id": user})
        assert r.status_code == 200, r.text
    connect(page)
    page.wait_for_selector("#scopes button:has-text('U+0430')")
    labels = page.locator("#scopes button").all_inner_texts()
    cyrillic = [t for t in labels if "U+0430 U+0440 U+0435" in t]
    latin = [t for t in labels if t.startswith('user_id="ape"')]
    assert len(cyrillic) == 1 and len(latin) == 1 and "U+" not in latin[0], labels


def test_the_docs_way_of_driving_the_page_from_playwright_runs_as_written(served, tmp_path):
    """docs/server.md's block (issue 56 item 5): Debian's Chromium, the key typed in, waits on
    selectors under the page's own CSP (no bypass), run as a script against this server."""
    import re
    import subprocess
    import sys

    section = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text().split(
        "**Driving the page from a browser tool**", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "drive.py"
    script.write_text(code.replace("http://127.0.0.1:8000", served.url).replace("<key>", KEY))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert USER in done.stdout and "bob" in done.stdout, done.stdout
