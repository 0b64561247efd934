"""Render the pictures of docs/guides/see-a-run.md from two run folders with headless Chromium.

    python docs/scripts/see_a_run_pictures.py QUICKSTART_RUN HACKED_RUN [ASYNC_RUN]

QUICKSTART_RUN: a quickstart run with traced steps; HACKED_RUN: one trained with
examples/rewards/pays_for_length.py; ASYNC_RUN: a traced run with trainer.async_mode on.
Writes docs/guides/images/see-a-run-*.png.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rlhf.report import build_report

OUT = Path(__file__).resolve().parents[1] / "guides" / "images"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars")


def shoot(page_html: str, png: Path, *, size: str) -> None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("no chromium: apt-get install chromium")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "page.html"
        page.write_text(page_html, encoding="utf-8")
        subprocess.run([exe, *FLAGS, f"--user-data-dir={tmp}/profile", f"--screenshot={png}",
                        f"--window-size={size}", page.as_uri()], check=True,
                       capture_output=True, timeout=120)
    print(f"wrote {png}")


def main(quickstart: str, hacked: str, async_run: str | None = None) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    run, hack = Path(quickstart), Path(hacked)
    shoot(build_report(run, only=("time", "roles", "memory")),
          OUT / "see-a-run-report.png", size="1280,1300")
    shoot(build_report(run, only=("timeline",)), OUT / "see-a-run-timeline.png",
          size="1280,1500")
    shoot(build_report(hack, only=("samples",)), OUT / "see-a-run-hacked-samples.png",
          size="1280,1100")
    if async_run:
        shoot(build_report(Path(async_run), only=("timeline",)),
              OUT / "see-a-run-async-timeline.png", size="1280,900")


if __name__ == "__main__":
    main(*sys.argv[1:4])
