"""The protocol contract travels with the repository: docs/PROTOCOL.md is a verbatim copy of the team's
../shared/PROTOCOL.md (when that is beside the checkout, as in CI)."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "PROTOCOL.md"


def test_docs_protocol_is_the_shared_contract_verbatim():
    if not SHARED.is_file():
        pytest.skip("../shared/PROTOCOL.md is not beside this checkout")
    assert (ROOT / "docs" / "PROTOCOL.md").read_text() == SHARED.read_text(), \
        "docs/PROTOCOL.md differs from ../shared/PROTOCOL.md: copy it again"


def test_docs_link_to_the_contract_in_the_repository():
    assert "docs/PROTOCOL.md" in (ROOT / "README.md").read_text()
    assert "PROTOCOL.md" in (ROOT / "docs" / "protocol.md").read_text()
    assert "../shared" not in (ROOT / "docs" / "protocol.md").read_text()
