"""A real TensorBoard server and Debian's headless Chromium (selenium + /usr/bin/chromedriver): load a
dashboard, wait until its charts are drawn, read the rendered page (tensorboard_page.js) and screenshot it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dist_utils import free_port

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PAGE_JS = (Path(__file__).parent / "tensorboard_page.js").read_text()
DASHBOARDS = {"scalars": "tf-scalar-dashboard", "custom_scalars": "tf-custom-scalar-dashboard",
              "images": "tf-image-dashboard"}


def missing() -> str | None:
    """Why the browser test cannot run here (None when it can)."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        return "needs Debian's chromium: apt-get install -y chromium chromium-driver"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium: pip install selenium"
    return None


@contextlib.contextmanager
def tensorboard(logdir: Path, runs: int, timeout: float = 120.0) -> Iterator[str]:
    """``tensorboard --logdir logdir`` on a free port; yields its URL once it lists ``runs`` runs."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
                             "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError):
                listed = json.loads(urllib.request.urlopen(f"{url}/data/runs", timeout=5).read())
                tags = json.loads(urllib.request.urlopen(f"{url}/data/plugin/scalars/tags", timeout=5).read())
                if len(listed) == runs and len(tags) == runs:
                    break
            if time.time() > deadline or proc.poll() is not None:
                raise AssertionError(f"TensorBoard on {logdir} did not list {runs} runs in {timeout:.0f} s")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Browser:
    """Headless Chromium driven by chromedriver (Debian's; selenium downloads nothing)."""

    def __init__(self) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--window-size=1600,1200"):
            opts.add_argument(arg)
        self.driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or CHROMEDRIVER),
                                       options=opts)
        self.driver.command_executor.client_config.timeout = 600  # a busy machine: slow pages
        self.driver.set_script_timeout(300)  # walking every shadow root is slow on a busy machine
        self.driver.set_page_load_timeout(300)

    def read(self, url: str, page: str, shot: Path, timeout: float = 120.0) -> dict[str, Any]:
        """Open ``page`` (#scalars, ...), wait until every card has drawn lines (images: loaded), two reads
        alike; returns the page (tensorboard_page.js) and writes the screenshot ``shot``."""
        self.driver.get("about:blank")
        self.driver.get(f"{url}/#{page}")
        deadline, last = time.time() + timeout, None
        while True:
            time.sleep(2)
            seen = json.loads(self.driver.execute_script(PAGE_JS, DASHBOARDS[page]))
            done = seen["images"] if page == "images" else \
                seen["cards"] and all(c["paths"] for c in seen["cards"])
            if (done and seen == last) or time.time() > deadline:
                break
            last = seen
        self.driver.save_screenshot(str(shot))
        return seen

    def close(self) -> None:
        self.driver.quit()
