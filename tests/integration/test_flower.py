"""Flower, the monitoring UI of the Procfile, seen through a real headless browser.

With the worker stack running, the Procfile's `flower` line is started BEFORE a job is submitted
(Flower only knows tasks whose events it saw since it started). After the job ends, headless
chromium (driven by Selenium) opens Flower's tasks page, filters it to the station tasks, and waits
until rows for generate, verify and train are rendered with readable arguments (argsrepr: station,
job, tenant, version). The screenshot is kept under $MARLAAS_HOME/artifacts/ and copied to
results/flower_tasks.png.

Needs Debian's `chromium` and `chromium-driver` (the test skips without them).
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from marlaas import Client, JobSpec
from marlaas.ops.embedded import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# Debian's packages `chromium` and `chromium-driver` (.ci/run installs them).
CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")
CHROMEDRIVER = Path(shutil.which("chromedriver") or "/usr/bin/chromedriver")
STATIONS = ("marlaas.generate", "marlaas.verify", "marlaas.train")
TASKS_COLUMNS = "name,uuid,state,args,received,runtime,worker"


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"Flower did not answer {url} within {timeout:.0f} s (see logs/flower.log)")


def _browser(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--window-size=1600,1000"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)


def test_flower_shows_station_tasks(worker_stack, home):
    pytest.importorskip("selenium")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("needs Debian's chromium and chromium-driver (see .ci/run)")
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # Flower 2.2's tasks list hides the args column by default; FLOWER_TASKS_COLUMNS (Flower reads
    # FLOWER_<OPTION> variables) shows it, as docs/deployment.md describes.
    user, password = worker_stack.env["MARLAAS_FLOWER_AUTH"].split(":", 1)
    worker_stack.start("flower", env={"MARLAAS_FLOWER_PORT": str(port), "FLOWER_TASKS_COLUMNS": TASKS_COLUMNS})
    profile = Path(tempfile.mkdtemp(prefix="marlaas-chromium-"))
    driver = None
    try:
        _wait_http(f"{base}/healthcheck", timeout=60)
        # Flower subscribes to the event stream after its HTTP server is up: wait until it has seen a
        # task (beat's 1 s scheduler tick), so none of the job's task events can be missed.
        # Anonymous requests are refused: the pages and the API (which can revoke tasks) need the login.
        for path in ("/tasks", "/api/tasks?limit=1", "/api/workers"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"{base}{path}", timeout=10)
            assert e.value.code == 401, path
        _wait_seen_a_task(f"{base}/api/tasks?limit=1", timeout=30, auth=(user, password))

        client = Client()  # a tenant, through the API
        tenant = "flower-tenant"
        job = client.submit(JobSpec(tenant=tenant, task="sort", steps=2, prompts_per_step=2, group_size=4,
                                    eval_size=4, seed=7))
        assert job.wait(timeout=240)["status"] == "done"

        driver = _browser(profile)
        login = f"http://{user}:{password}@127.0.0.1:{port}"  # the browser logs in with basic auth
        driver.get(f"{login}/tasks")
        wait = WebDriverWait(driver, 60, poll_frequency=0.5)
        # The scheduler tick runs every second and floods the list: show only the station tasks
        # (their argsrepr starts with "station="), up to 100 per page.
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#tasks-table tbody tr"))
        Select(driver.find_element(By.CSS_SELECTOR, "select[aria-label='Tasks per page'], "
                                                    "#tasks-table_length select")).select_by_value("100")
        box = driver.find_element(By.CSS_SELECTOR, "input[type='search']")
        box.clear()
        box.send_keys("station=")

        def rendered(d):
            text = d.find_element(By.ID, "tasks-table").text
            return text if all(name in text for name in STATIONS) and f"job={job.id}" in text else False

        try:
            text = wait.until(rendered)
        except TimeoutException:
            shot = home / "artifacts" / "flower_tasks_failed.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(shot))
            pytest.fail(f"Flower's tasks page never listed the station tasks of {job.id}; it showed:\n"
                        f"{driver.find_element(By.TAG_NAME, 'body').text[:3000]}")
        # Readable arguments: what each station task is doing, for which job and tenant.
        assert f"station=train job={job.id} tenant={tenant} version=0" in text
        assert f"station=train job={job.id} tenant={tenant} version=1" in text
        assert f"station=verify job={job.id} tenant={tenant}" in text
        assert "station=generate" in text and f"job={job.id} tenant={tenant} [" in text

        shot = home / "artifacts" / "flower_tasks.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000

        # The list truncates long arguments; a task's own page shows them whole.
        # The table re-renders as tasks arrive: find the row and read its id in one go, retried.
        def first_train_row(d):
            try:
                return next((tr.get_attribute("id") for tr in d.find_elements(By.CSS_SELECTOR, "#tasks-table tbody tr")
                             if f"station=train job={job.id} tenant={tenant} version=0" in tr.text), False)
            except StaleElementReferenceException:
                return False

        try:
            uuid = wait.until(first_train_row)
        except TimeoutException:
            pytest.fail("no row for the first train task")
        driver.get(f"{login}/task/{uuid}")
        wait.until(lambda d: f"station=train job={job.id} tenant={tenant} version=0" in d.find_element(
            By.TAG_NAME, "body").text)
        detail = home / "artifacts" / "flower_task_train.png"
        assert driver.save_screenshot(str(detail))

        (ROOT / "results").mkdir(exist_ok=True)
        shutil.copyfile(shot, ROOT / "results" / "flower_tasks.png")
        shutil.copyfile(detail, ROOT / "results" / "flower_task_train.png")
    finally:
        if driver is not None:
            driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
        worker_stack.kill("flower")


def _wait_seen_a_task(url: str, timeout: float, auth: tuple[str, str]) -> None:
    token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    req = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                if json.loads(r.read()):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"Flower saw no task event within {timeout:.0f} s (workers need -E; see logs/flower.log)")
