"""The Dagster UI as a person sees it: a real `dagster-webserver` on a demo instance with one range
extracted, opened in headless Chromium (Debian's package; scripts/test.sh installs it). The asset's
partitions, the latest range's progress figures and the run's progress tag must be on the page.
Screenshots are kept in test-artifacts/ (or $DFLASH_TEST_ARTIFACTS)."""

import contextlib
import html
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from dagster import AssetKey, AssetRecordsFilter

from dflash_assets_tests.conftest import REPO, open_instance
from dflash_assets_tests.support.s3_server import free_port

KEY = "00000000-00000023"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("DFLASH_TEST_ARTIFACTS", REPO / "test-artifacts"))

if CHROMIUM is None and os.environ.get("CI"):
    raise RuntimeError("chromium is missing: scripts/test.sh installs it (apt-get install chromium)")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium: run scripts/test.sh, which installs it"
)


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


@pytest.fixture(scope="module")
def ui(demo_ranges):
    """The Dagster UI on the instance where the shared ranges were materialised (conftest's
    `demo_ranges`: every range registered, two of them tokenized and extracted)."""
    env = dict(demo_ranges.env)
    port = free_port()
    server = subprocess.Popen(
        [_bin("dagster-webserver"), "-m", "dflash_assets.definitions", "-h", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{url}/server_info", timeout=5).status == 200:
                    break
            assert server.poll() is None, "dagster-webserver exited"
            assert time.monotonic() < deadline, "dagster-webserver did not come up"
            time.sleep(1)
        yield {"url": url, "env": env, "registered": demo_ranges.registered_ranges}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _chromium(*args: str) -> str:
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--window-size=1920,1200",
            "--virtual-time-budget=30000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _page_text(url: str, expected: list[str], screenshot: str, tries: int = 3) -> str:
    """The page's text once every `expected` item is on it (or after `tries` loads), with a screenshot
    of that same load kept as `screenshot` in the artifacts folder."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / screenshot
    for _ in range(tries):
        path.unlink(missing_ok=True)
        dom = _chromium(f"--screenshot={path}", "--dump-dom", url)
        dom = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", dom, flags=re.S)
        text = html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom)))
        if all(item in text for item in expected):
            break
    assert path.stat().st_size > 10_000  # a rendered page, not a blank one
    return text


def test_the_asset_page_lists_the_ranges_with_the_extracted_one_materialised(ui):
    registered = ui["registered"]
    url = f"{ui['url']}/assets/hidden_state_partitions?view=partitions&partition={KEY}"
    expected = [KEY, "Materialized (2)", f"Missing ({registered - 2})", "samples_per_s", "reused_from_store"]
    text = _page_text(url, expected, "ui-partitions.png")
    for item in expected:
        assert item in text, f"{item!r} is not on the partitions page"


def test_the_latest_range_progress_observation_shows_its_figures(ui):
    with open_instance(ui["env"]["DAGSTER_HOME"]) as instance:
        this_range = AssetRecordsFilter(asset_key=AssetKey("hidden_state_partitions"), asset_partitions=[KEY])
        latest = instance.fetch_observations(this_range, limit=1).records[0]
    # `time` selects that event in the asset's event list, as clicking it would.
    event_time = int(latest.timestamp * 1000)
    url = f"{ui['url']}/assets/hidden_state_partitions?view=events&partition={KEY}&time={event_time}"
    figures = [
        "fraction_done",
        "samples_per_s",
        "eta_s",
        "staging",
        "uploads_in_flight",
        "device",
        "100% 24/24",
    ]
    text = _page_text(url, figures, "ui-range-progress.png")
    for figure in figures:
        assert figure in text, f"{figure!r} is not shown for the range's latest progress observation"


def test_the_runs_list_shows_the_runs_progress_tag(ui):
    url = f"{ui['url']}/runs"
    text = _page_text(url, ["dflash/progress: 100% 24/24"], "ui-runs.png")
    assert "dflash/progress: 100% 24/24" in text
