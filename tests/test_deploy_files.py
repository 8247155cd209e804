"""The deployment files start the same command the Procfile does, with the settings contract."""

from __future__ import annotations

import configparser

from tests.conftest import ROOT


def test_systemd_unit_runs_the_server_with_its_settings() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((ROOT / "deploy" / "dejafix.service").read_text())
    service = unit["Service"]
    assert service["ExecStart"].endswith("python -m bot serve")
    assert service["EnvironmentFile"] == "/etc/dejafix.env"
    assert "DEJAFIX_DATA_DIR=" in service["Environment"]
    assert service["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_container_image_runs_the_server_unprivileged_with_a_data_volume() -> None:
    text = (ROOT / "deploy" / "Containerfile").read_text()
    assert 'CMD ["python", "-m", "bot", "serve"]' in text
    assert "DEJAFIX_DATA_DIR=/data" in text and 'VOLUME ["/data"]' in text
    assert "USER dejafix" in text and "/healthz" in text
    # Everything the image copies exists (the build would fail otherwise).
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source


def test_deploy_guide_is_linked_from_the_readme() -> None:
    assert "docs/deploy.md" in (ROOT / "README.md").read_text()
