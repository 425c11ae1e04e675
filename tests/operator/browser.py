"""A headless Chromium (Debian's `chromium` and `chromium-driver`) driven by selenium, for the
dashboard tests. Every call blocks: tests call it through asyncio.to_thread, since their own event
loop serves the API server emulator the dashboard watches."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def need_chromium() -> None:
    """The browser tests fail (they do not skip) without a browser: the dashboard is what users open."""
    if not (CHROMIUM and DRIVER):
        pytest.fail("needs Debian's chromium and chromium-driver (make test installs them as root: "
                    "apt-get install chromium chromium-driver)", pytrace=False)
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.fail("needs selenium (pip install -e '.[dev]')", pytrace=False)


class Browser:
    def __init__(self, shots: Path, width: int = 1440, height: int = 1400):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    f"--window-size={width},{height}", "--no-first-run", "--disable-extensions"):
            options.add_argument(arg)
        self.driver = webdriver.Chrome(service=Service(DRIVER), options=options)
        self.shots = shots
        shots.mkdir(parents=True, exist_ok=True)

    def quit(self) -> None:
        self.driver.quit()

    def open(self, url: str) -> None:
        self.driver.get(url)

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait_js(self, script: str, timeout: float, what: str):
        """Wait until `script` (a JS expression's body: `return ...`) answers truthy; return it."""
        from selenium.common.exceptions import TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            return WebDriverWait(self.driver, timeout, poll_frequency=0.2).until(lambda d: d.execute_script(script))
        except TimeoutException:
            detail = self.js("const d = document.getElementById('detail'); return d ? d.innerText.slice(0, 1500) : ''")
            self.screenshot(f"timeout-{what.replace(' ', '-')[:40]}")
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; the page shows:\n{detail}") from None

    def click(self, css: str, tries: int = 50) -> None:
        """A real click on `css`; found again when the page redrew it between finding and clicking
        (every change the stream brings redraws the list and the rollout's view)."""
        from selenium.common.exceptions import StaleElementReferenceException

        for _ in range(tries - 1):
            try:
                self.driver.find_element("css selector", css).click()
                return
            except StaleElementReferenceException:
                time.sleep(0.05)
        self.driver.find_element("css selector", css).click()

    def screenshot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path


async def start_dashboard(kubeconfig: str, namespace: str, log: Path):
    """`graft dashboard` as a person starts it, on a free port; answers (process, its address)."""
    import asyncio

    out = open(log, "wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "graft.cli", "dashboard", "--kubeconfig", kubeconfig, "-n", namespace, "--port", "0",
        stdout=subprocess.PIPE, stderr=out)
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    assert line.startswith("Graft dashboard for namespace"), line
    return proc, line.rsplit(" ", 1)[1].strip()
