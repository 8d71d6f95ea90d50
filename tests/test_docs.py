"""The docs cannot drift: the configuration reference is generated from the config
models and must be current; the protocol page names every message and field; every TOML
block of the docs loads. (Every file in configs/ loads in tests/test_config.py.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from supervisor.config import reference
from supervisor.config.models import BACKEND_OPTIONS, ModelConfig
from supervisor.config.server import ServerConfig
from supervisor.config.tenants import TenantConfig
from tests.pool import ROOT


def test_configuration_reference_is_current():
    assert reference.PAGE.read_text() == reference.render(), \
        "docs/configuration-reference.md is stale: run python -m supervisor.config.reference"


def test_configuration_reference_names_every_key():
    page = reference.PAGE.read_text()
    for model in (ServerConfig, ModelConfig, TenantConfig, *BACKEND_OPTIONS.values()):
        for key, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{key} has no description"
            assert f"| `{key}` |" in page, f"{model.__name__}.{key} is missing from the reference"


def test_a_field_without_description_fails_the_generator():
    from pydantic import Field

    from supervisor.config.common import Strict

    class Undocumented(Strict):
        documented: int = Field(1, description="has one")
        bare: int = 2
    with pytest.raises(ValueError, match="Undocumented.bare has no description"):
        reference.section("[x]", Undocumented, "")


def test_protocol_page_names_every_message_and_field():
    """docs/protocol.md is hand-written: it must name every message type, every field and
    the version, so a new message or field cannot go unmentioned."""
    import dataclasses

    from protocol import PROTOCOL_VERSION
    from protocol.messages import MESSAGE_TYPES
    page = (Path(ROOT) / "docs" / "protocol.md").read_text()
    assert f"version {PROTOCOL_VERSION}" in page
    for tag, cls in MESSAGE_TYPES.items():
        assert f"| `{tag}` |" in page, f"message {tag!r} is not in docs/protocol.md"
        row = next(line for line in page.splitlines() if line.startswith(f"| `{tag}` |"))
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in row, f"field {tag}.{f.name} is not in its row of docs/protocol.md"


def _toml_blocks():
    from tests.doc_blocks import all_blocks
    for block in all_blocks():
        if block.lang == "toml":
            marks = [pytest.mark.ray] if 'placement = "ray"' in block.code else []
            yield pytest.param(block, id=block.where, marks=marks)


@pytest.mark.parametrize("block", list(_toml_blocks()))
def test_toml_in_the_docs_is_valid(block):
    """Every TOML block of the docs parses; one whose models all name a backend is a whole
    config, and loads (placement "ray" ones in the Ray tier, which has Ray)."""
    import tomllib

    from supervisor.config import parse_config
    raw = tomllib.loads(block.code)
    if 'placement = "ray"' in block.code and importlib.util.find_spec("ray") is None:
        pytest.skip("needs the ray extra (scripts/test-ray installs it)")
    models = raw.get("models", [])
    if models and all("backend" in m for m in models):
        assert parse_config(raw, source=block.where).models


def test_the_readmes_links_lead_somewhere():
    """The README is not part of the site (mkdocs checks the site's links): its links into
    docs/ name pages that exist and headings they have."""
    import re
    readme = (Path(ROOT) / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", readme)
    assert len(links) >= 10, links
    for target, anchor in links:
        page = Path(ROOT) / target
        assert page.is_file(), target
        if anchor:
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}
            assert anchor in slugs, f"{target} has no heading #{anchor}"
