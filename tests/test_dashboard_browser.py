"""The dashboard in a real browser: Debian's chromium, headless, driven by Selenium through the
system's chromedriver (no browser is downloaded). Through the gateway, logged in with an admin
key, over a real redis-server and a worker on the simulated engine: the overview sees the worker,
a job's stream grows live on its page, another is cancelled, a dead letter (a job past its start
deadline) is retried and fails again with its reason, and a prompt holding a script never runs.

With QWORKER_DASHBOARD_SCREENSHOTS=1 the screenshots of each page go to docs/dashboard/ (what
docs/dashboard.md shows); else to a temporary folder."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from qworker_client.client import Producer
from qworker_client.protocol import Keys
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import sim_engine, submit, wait_for

KEYS = Keys()
ADMIN_KEY = "sk-admin-browser-test"
SCRIPT = "<script>window.__pwned=1</script>"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "dashboard"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[test]')")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no chromium and chromedriver on PATH (apt-get install chromium "
                "chromium-driver; `make browser` does)", allow_module_level=True)


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    if os.environ.get("QWORKER_DASHBOARD_SCREENSHOTS") == "1":
        DOCS.mkdir(exist_ok=True)
        return DOCS
    return tmp_path


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1100,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: WebDriver, what: str, check: object, timeout: float = 20) -> None:
    WebDriverWait(driver, timeout, poll_frequency=0.1).until(check, message=what)


def text(driver: WebDriver, element_id: str) -> str:
    return str(driver.find_element(By.ID, element_id).text)


def test_the_dashboard_in_a_browser(redis_url: str, browser: WebDriver, shots: Path) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with live_worker(redis_url, "w-browser", engine=sim_engine("sim:step_ms=40")), \
            gateway(redis_url, api_keys=("sk-viewer",), admin_keys=(ADMIN_KEY,)) as base:
        board = f"{base}/dashboard"
        browser.get(board + "/")
        assert browser.current_url.endswith("/login")
        browser.find_element(By.ID, "key").send_keys(ADMIN_KEY)
        browser.find_element(By.ID, "login").click()
        wait(browser, "the overview to show the worker",
             lambda d: "1 live worker" in text(d, "live-workers"))

        browser.get(board + "/workers")
        assert "w-browser" in text(browser, "workers")
        browser.save_screenshot(str(shots / "workers.png"))

        producer = Producer(redis_url)
        producer.submit("Tell me a story", id="stream1", max_tokens=200)  # 8 s
        browser.get(board + "/jobs/stream1")
        wait(browser, "its first tokens", lambda d: len(text(d, "output")) > 0)
        first = len(text(browser, "output"))
        wait(browser, "its stream to grow", lambda d: len(text(d, "output")) > first)
        assert text(browser, "ttft") and text(browser, "status") == "running"
        assert "Tell me a story" in browser.find_element(By.CSS_SELECTOR, "dl.fields").text
        browser.save_screenshot(str(shots / "job.png"))
        wait(browser, "it to end", lambda d: text(d, "status") == "done", timeout=30)
        assert text(browser, "finish") == "length" and text(browser, "tokens") == "200"
        done = client.xrevrange(KEYS.out("stream1"), count=1)[0][1]
        assert text(browser, "output") == done["text"].strip()

        submit(client, "cancel1", prompt="Go on forever", max_tokens=5000)
        browser.get(board + "/jobs/cancel1")
        wait(browser, "it to run", lambda d: len(text(d, "output")) > 0)
        browser.find_element(By.ID, "cancel").click()
        browser.switch_to.alert.accept()
        wait(browser, "the page after the cancel", lambda d: "flash=" in d.current_url)
        assert "cancelling" in text(browser, "flash")
        wait(browser, "it to end cancelled", lambda d: text(d, "finish") == "cancelled")

        client.xadd(KEYS.jobs, {"id": "late1", "prompt": "too late", "deadline_ms": "1"})
        wait_for(lambda: client.xlen(KEYS.dead) == 1, what="the late job's dead letter")
        browser.get(board + "/dead")
        assert "expired" in text(browser, "dead")
        browser.find_element(By.CSS_SELECTOR, "#dead button.retry").click()
        wait(browser, "the page after the retry", lambda d: "flash=" in d.current_url)
        assert "queued again: 1" in text(browser, "flash")
        wait_for(lambda: client.xlen(KEYS.dead) == 1 and client.xlen(KEYS.jobs) == 0,
                 what="the retried job to be dead-lettered again")
        browser.get(board + "/dead")
        row = text(browser, "dead")
        assert "late1" in row and "expired" in row
        browser.save_screenshot(str(shots / "dead.png"))

        producer.submit(SCRIPT, id="xss1", model="nobody", max_tokens=8)  # stays queued
        for path in ("/jobs/xss1", "/jobs", "/"):
            browser.get(board + path)
            assert browser.execute_script("return typeof window.__pwned") == "undefined", path
        browser.get(board + "/jobs/xss1")
        assert SCRIPT in browser.find_element(By.CSS_SELECTOR, "dl.fields").text

        browser.get(board + "/jobs")
        assert "stream1" in text(browser, "jobs") and "cancel1" in text(browser, "jobs")
        browser.save_screenshot(str(shots / "jobs.png"))
        time.sleep(0.1)
        browser.get(board + "/")
        wait(browser, "a throughput chart", lambda d: d.find_elements(By.CSS_SELECTOR,
                                                                       "svg.bars rect"))
        browser.save_screenshot(str(shots / "overview.png"))
        browser.set_window_size(390, 844)  # a phone's width
        browser.get(board + "/jobs/stream1")
        assert browser.execute_script(
            "return document.documentElement.scrollWidth <= window.innerWidth + 1")
        browser.save_screenshot(str(shots / "phone-job.png"))
        producer.close()
    client.close()
