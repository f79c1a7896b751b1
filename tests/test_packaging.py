"""pyproject.toml in the form current setuptools builds without deprecation warnings."""
from __future__ import annotations

import re
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_license_is_an_spdx_expression_with_a_setuptools_that_reads_it():
    """``project.license`` as a table makes setuptools warn at every install (deprecated); the SPDX string form needs
    setuptools >= 77 (PEP 639), so the build requires at least that."""
    text = PYPROJECT.read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the two values by pattern
        license_ = re.search(r'^license\s*=\s*"([^"]*)"', text, re.M)
        req = re.search(r'^requires\s*=\s*\["setuptools>=([0-9]+)', text, re.M)
        assert license_ and license_.group(1) == "Apache-2.0" and req and int(req.group(1)) >= 77, text[:400]
        return
    data = tomllib.loads(text)
    assert data["project"]["license"] == "Apache-2.0"
    req = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    assert len(req) == 1 and int(re.match(r"setuptools>=([0-9]+)", req[0]).group(1)) >= 77, req
