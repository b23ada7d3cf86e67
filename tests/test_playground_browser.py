"""The playground page in a real browser (headless Debian chromium through chromedriver and selenium) against
the quick-start app: serve_config.yaml's args as shipped (the tiny checkpoint made on first start, 5-15 s clips),
on CPU, with its state under the test's tmp dir.

What a person does: open `/`, see a refused field's message next to it, submit a tiny request, watch it finish
and play (the `<video>` element's metadata: the snapped duration), see the thumbnail and the job in the list,
cancel a long job and delete a finished one from the list. A screenshot of the finished clip is saved under the
test's tmp dir (and, with $DITSERVE_PLAYGROUND_SCREENSHOT set, there too: docs/playground.png is made so).

Clip arithmetic (model.geometry): 5 s at 24 fps asks for 121 frames, snapped up to 17n + 5 = 124 frames = 5.1667 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from selenium import webdriver  # the dev extra: a missing one fails here rather than skipping the test
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.serve_helpers import APP_NAME, run_app, serve_cluster, serve_config_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[1]
SMALL_DURATION_S = 124 / 24  # 5 s requested, 124 frames
CLIP_TIMEOUT_S = 240.0  # a tiny CPU job shares two cores with Ray's own processes


def browser_binaries() -> tuple[str, str]:
    """chromium and chromedriver, installed through scripts/browser (as scripts/test does) when missing."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        subprocess.run([str(ROOT / "scripts" / "browser"), "install"], check=True)
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "scripts/browser install left no chromium/chromedriver on PATH"
    return chromium, driver


@pytest.fixture(scope="module")
def app_url(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("playground")
    args = serve_config_args(root / "checkpoints")
    args["engine"]["device"] = "cpu"
    args["jobs"].update({"state_dir": str(root / "state"), "events_poll_s": 0.2, "poll_s": 0.2})
    with serve_cluster() as url:
        run_app(url, args)
        wait_videos_ready(url)
        yield url
        from ray import serve

        serve.delete(APP_NAME)


def wait_videos_ready(url: str, timeout_s: float = 120.0) -> None:
    """The video routes answer 503 until the replica's job service started."""
    deadline = time.monotonic() + timeout_s
    while (status := requests.get(f"{url}/v1/videos", timeout=10).status_code) != 200:
        assert time.monotonic() < deadline, f"/v1/videos still {status} after {timeout_s} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    chromium, driver_path = browser_binaries()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1360,1000",
                 "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def open_playground(browser, url: str) -> None:
    browser.get(url + "/")
    # The model card arrived: the header names the served model.
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "model-id").text.startswith("minimax-h3@"))


def fill(browser, **fields: str) -> None:
    for name in ("prompt", "size", "aspect_ratio", "seconds", "num_inference_steps", "seed"):
        element = browser.find_element(By.ID, name)
        element.clear()
        if fields.get(name):
            element.send_keys(fields[name])
    browser.find_element(By.ID, "submit").click()


def field_error(browser, name: str, timeout_s: float = 30.0) -> str:
    """The message shown next to field `name` once it appears."""
    slot = browser.find_element(By.CSS_SELECTOR, f'[data-error-for="{name}"]')
    WebDriverWait(browser, timeout_s).until(lambda d: slot.text != "")
    return slot.text


def click(browser, selector: str) -> None:
    """Find and click in one script: the list is redrawn every 5 s, an element found earlier can be gone."""
    browser.execute_script("document.querySelector(arguments[0]).click()", selector)


def job_ids(browser) -> list[str]:
    return [row.get_attribute("data-id") for row in browser.find_elements(By.CSS_SELECTOR, "#jobs tr")]


def test_the_page_is_served_at_the_root_without_anything_from_elsewhere(app_url):
    page = requests.get(app_url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # works offline: no CDN, no fonts


def test_a_refused_field_shows_the_servers_message_next_to_it(app_url, browser):
    open_playground(browser, app_url)
    # No prompt: the schema's error (errors[].loc = ["prompt"]).
    fill(browser, prompt="", seconds="5")
    assert field_error(browser, "prompt") == "Field required"
    assert "invalid" in browser.find_element(By.ID, "prompt").get_attribute("class")
    # Over the model's limit: the job layer's field error, with the limit it names.
    fill(browser, prompt="a red fox in snow", seconds="99")
    assert field_error(browser, "seconds") == (
        "seconds: 99 snaps to 2385 frames = 99.375 s at 24 fps; the model's clips last min_seconds=5 to max_seconds=15")
    assert browser.find_element(By.ID, "prompt").get_attribute("class") == ""  # the earlier error was cleared
    assert browser.find_element(By.ID, "form-error").text == ""  # placed at its field, not in the general slot


def test_a_tiny_request_plays_in_the_video_element(app_url, browser, tmp_path):
    open_playground(browser, app_url)
    fill(browser, prompt="a red fox in snow", size="96x64", seconds="5", num_inference_steps="4", seed="3")
    # Metadata loaded: the MP4 was fetched from the content route and parsed by the browser's own demuxer.
    duration = WebDriverWait(browser, CLIP_TIMEOUT_S, poll_frequency=0.5).until(lambda d: d.execute_script(
        "const v = document.getElementById('player');"
        "return v.getAttribute('src') && v.readyState >= 1 && v.duration > 0 ? v.duration : null;"))
    assert duration == pytest.approx(SMALL_DURATION_S, abs=0.1)
    assert (browser.execute_script("return document.getElementById('player').videoWidth"),
            browser.execute_script("return document.getElementById('player').videoHeight")) == (96, 64)
    status = browser.find_element(By.ID, "job-status").text
    assert " · completed · 100%" in status
    video_id = status.split(" · ")[0]
    WebDriverWait(browser, 30).until(lambda d: d.execute_script(
        "const t = document.getElementById('thumbnail'); return t.complete && t.naturalWidth === 96;"))
    WebDriverWait(browser, 30).until(lambda d: video_id in job_ids(d))
    row = browser.find_element(By.CSS_SELECTOR, f'#jobs tr[data-id="{video_id}"]')
    assert "completed" in row.text
    browser.execute_script("document.getElementById('player').currentTime = 2.5")  # a frame past the first
    time.sleep(0.5)  # the seek's frame is painted (the screenshot is a picture, not an assertion)
    browser.save_screenshot(str(tmp_path / "playground.png"))
    assert (tmp_path / "playground.png").stat().st_size > 10_000
    if target := os.environ.get("DITSERVE_PLAYGROUND_SCREENSHOT"):
        browser.save_screenshot(target)


def test_the_job_list_cancels_a_running_job_and_deletes_a_finished_one(app_url, browser):
    open_playground(browser, app_url)
    # 65 steps of a 5 s 128x128 clip: long enough on a CPU to be cancelled while it runs.
    fill(browser, prompt="a long walk on the beach", size="128x128", seconds="5", num_inference_steps="65", seed="9")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "job-status").text.startswith("video_"))
    video_id = browser.find_element(By.ID, "job-status").text.split(" · ")[0]
    cancel = f'#jobs tr[data-id="{video_id}"] button:nth-of-type(2)'
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, cancel))
    click(browser, cancel)
    WebDriverWait(browser, CLIP_TIMEOUT_S).until(
        lambda d: " · cancelled · " in d.find_element(By.ID, "job-status").text)
    assert requests.get(f"{app_url}/v1/videos/{video_id}", timeout=10).json()["status"] == "cancelled"

    delete = f'#jobs tr[data-id="{video_id}"] button:last-of-type'
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.CSS_SELECTOR, delete).text == "delete")
    click(browser, delete)
    WebDriverWait(browser, 30).until(lambda d: video_id not in job_ids(d))
    assert browser.find_element(By.ID, "job-status").text == f"{video_id} deleted"
    assert requests.get(f"{app_url}/v1/videos/{video_id}", timeout=10).status_code == 404
