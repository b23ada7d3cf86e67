"""The playground page (deployments/playground.py, deployments/static/playground.html) without a browser:
shipped as package data, served or switched off by `http.playground`, and only speaking the public API.
The page in a real browser against the app: tests/test_playground_browser.py (slow)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from deployments.ingress import served_model
from deployments.playground import PLAYGROUND_FILE, playground_page, playground_response
from deployments.schemas import HttpOptions
from engine.limits import ServedAdapter, served_limits
from jobs.media import MEDIA_FIELDS
from jobs.schemas import VideoCreateRequest

ROOT = Path(__file__).resolve().parents[1]


def test_the_page_is_package_data_of_deployments():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["deployments"]
    assert any(Path(PLAYGROUND_FILE).match(pattern) for pattern in patterns)
    assert playground_page() == (ROOT / "deployments" / PLAYGROUND_FILE).read_text()


def test_on_by_default_it_serves_the_page_and_off_it_answers_404_in_the_error_shape():
    assert HttpOptions().playground is True
    page = playground_response(HttpOptions().playground)
    assert page.status_code == 200 and page.media_type == "text/html" and b"ditserve playground" in page.body
    off = playground_response(HttpOptions(playground=False).playground)
    assert off.status_code == 404
    assert b'"type":"not_found"' in off.body and b"http.playground: false" in off.body


def test_the_page_fetches_nothing_from_elsewhere():
    page = playground_page()
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", page)  # no CDN, no web fonts: works offline
    assert not re.search(r"<(?:script|link)[^>]+(?:src|href)=", page)  # everything inline


def test_every_field_the_form_posts_is_a_field_of_the_create_body():
    names = set(re.findall(r'<(?:input|select|textarea)[^>]*\bname="([a-z_]+)"', playground_page()))
    assert {"prompt", "size", "aspect_ratio", "seconds", "num_inference_steps", "seed", "quality"} <= names
    assert "lora" in names  # the adapter picker: shown only when GET /v1/models lists adapters
    assert names <= set(VideoCreateRequest.model_fields)


def test_the_adapter_picker_reads_the_adapters_where_v1_models_lists_them_and_posts_a_name_as_lora():
    page = playground_page()
    # `limits.adapters` (name and defaults) of every served model; the card's top-level `adapters` is an object
    # (what the replica holds now), whose `.length` is undefined: the picker never showed.
    assert "(m.limits || {}).adapters" in page and "card.adapters" not in page
    limits = served_limits("minimax-h3", max_steps=65, short_edge=None, max_pixels=128 * 128, size_multiple=32,
                           min_seconds=0.2, max_seconds=5.0, fps=24, frames_per_chunk=17, frame_offset=5,
                           max_prompt_tokens=64, default_flow_shift=12.0, default_audio_flow_shift=3.0,
                           adapters=(ServedAdapter(name="turbo-tiny", steps=5),))
    entry = served_model({"id": "minimax-h3@abc", "limits": limits.model_dump(mode="json"),
                          "adapters": {"served": ["turbo-tiny"], "held": ["turbo-tiny"], "fused": None}})
    assert [(a["name"], a["steps"]) for a in entry["limits"]["adapters"]] == [("turbo-tiny", 5)]
    # The picked option's value is the name, sent as the field `lora` (a form sends it as text).
    assert re.search(r'<select id="lora" name="lora">', page)
    assert VideoCreateRequest.model_validate({"prompt": "a fox", "lora": "turbo-tiny"}).lora.name == "turbo-tiny"


def test_every_upload_a_task_shows_is_a_media_field_of_the_create_body():
    block = re.search(r"const TASK_INPUTS = \{(.*?)\n\};", playground_page(), re.S).group(1)
    fields = set(re.findall(r'\["([a-z_]+)", "', block))
    assert fields == {"input_references", "image_references", "video_reference", "audio_reference"}
    assert fields <= set(MEDIA_FIELDS) and fields <= set(VideoCreateRequest.model_fields)


def test_the_page_calls_only_routes_of_the_public_api():
    routes = set(re.findall(r'[`"](v1/[a-z]+)', playground_page()))
    assert routes == {"v1/models", "v1/videos"}
