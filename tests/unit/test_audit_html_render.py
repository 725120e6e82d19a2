"""The HTML report renders in headless Chromium (Debian's chromium package, installed by
scripts/install.sh --test): a screenshot of the page is not blank and shows the plots."""

import shutil
import subprocess

import numpy as np
import pytest

from tests.audit_tiny import one_thread, tiny_audit, tiny_models
from verispec.audit.report import write_reports

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/install.sh --test installs it)")
def test_report_renders_in_headless_chromium(tmp_path):
    with one_thread():
        report = tiny_audit(tiny_models()).to_dict()
    html = write_reports(report, tmp_path / "report")["html"]
    text = html.read_text()
    assert text.count("src='data:image/png;base64,") == 5
    png = tmp_path / "shot.png"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", "--window-size=1280,2400",
           "--hide-scrollbars", html.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.exists(), f"no screenshot (rc {proc.returncode}): {proc.stderr[-2000:]}"
    import matplotlib.image
    img = matplotlib.image.imread(str(png))[..., :3]  # [H, W, 3] floats in [0, 1]
    assert img.shape[:2] == (2400, 1280)
    assert img.std() > 0.05  # not blank
    # the plots: many saturated pixels (bars, histogram) in the plot grid below the tables
    colourful = (img.max(-1) - img.min(-1)) > 0.3
    assert colourful.sum() > 20_000, colourful.sum()
    rows = np.nonzero(colourful.any(axis=1))[0]
    assert rows.max() - rows.min() > 400  # spread over the page, not one badge
