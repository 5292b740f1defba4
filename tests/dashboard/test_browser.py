"""The dashboard in a real browser (Debian's headless Chromium) against a live stack.

A real worker, admission service and dashboard run as processes on this test's topics and
Redis prefix; traffic goes through admission over HTTP. The test reads the page as a person
would: the tight budget on top with its numbers, a refusal and an alert appearing without a
reload, and a tenant-A session that never shows tenant B. It saves the screenshot the
README shows (``docs/dashboard.png``).
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from spendgate.schemas.policies import Policy
from tests.fixtures.dashboard import StartStack, wait_for
from tests.fixtures.key_ids import key_id

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "dashboard.png"
TOKENS = 'tok-a: [a]\ntok-b: [b]\ntok-ops: operator\ntok-all: "*"\n'
ALL = {"Authorization": "Bearer tok-all"}
TIGHT = Policy.model_validate(
    {
        "id": "tight",
        "unit": "requests",
        "limit": 5,
        "window": "5m",
        "bucket": "10s",
        "group_by": ["tenant"],
    }
)
LOOSE = Policy.model_validate(
    {
        "id": "loose-tokens",
        "unit": "total_tokens",
        "limit": 1_000_000,
        "window": "5m",
        "bucket": "10s",
        "group_by": ["tenant", "api_key"],
    }
)


def admit(url: str, tenant: str, requests: int = 1, tokens: int = 100) -> httpx.Response:
    body = {
        "request_id": uuid.uuid4().hex,
        "subject": {"tenant": tenant, "api_key": f"{tenant}-key-1", "model": "m1"},
        "estimate": {"requests": requests, "input_tokens": tokens},
    }
    return httpx.post(f"{url}/v1/admit", json=body, headers=ALL, timeout=10)


def spend(url: str, tenant: str, n: int) -> None:
    """``n`` requests admitted and committed in full."""
    for _ in range(n):
        answer = admit(url, tenant)
        assert answer.status_code == 200, answer.text
        commit = {
            "reservation_id": answer.json()["reservation_id"],
            "usage": {"requests": 1, "input_tokens": 100},
        }
        done = httpx.post(f"{url}/v1/commit", json=commit, headers=ALL, timeout=10)
        assert done.status_code == 202, done.text


def sign_in(driver: Any, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(url + "/")
    wait_for("the sign-in form", lambda: driver.find_element(By.ID, "sign-in").is_displayed())
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#sign-in-form button").click()
    wait_for("the signed-in page", lambda: driver.find_element(By.ID, "main").is_displayed())
    assert token not in driver.current_url
    stored = driver.execute_script(
        "return JSON.stringify(localStorage) + JSON.stringify(sessionStorage) + document.cookie"
    )
    assert token not in stored, "the token (or a readable cookie) is kept by the page"


def rows(driver: Any) -> list[dict[str, str]]:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return [
            {
                "key": tr.get_attribute("data-key"),
                "usage": tr.find_element(By.CSS_SELECTOR, "td.usage").text,
                "retry": tr.find_element(By.CSS_SELECTOR, "td.retry").text,
                "window": tr.find_element(By.CSS_SELECTOR, "td.window").text,
            }
            for tr in driver.find_elements(By.CSS_SELECTOR, "#budgets tbody tr")
        ]
    except StaleElementReferenceException:  # redrawn while read: read again
        return []


def text_of(driver: Any, selector: str) -> str:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return " ".join(e.text for e in driver.find_elements(By.CSS_SELECTOR, selector))
    except StaleElementReferenceException:
        return ""


def shown_seconds(cell: str) -> tuple[float, float]:
    """The interval of seconds a Retry-After cell can stand for (``app.js`` ``seconds``:
    ``"45s"``, ``"5m"`` rounded to the minute, ``"1.5h"`` to a tenth of an hour)."""
    match = re.fullmatch(r"(\d+(?:\.\d)?)(s|m|h)", cell.strip())
    assert match, f"not a duration: {cell!r}"
    value, unit = float(match[1]), match[2]
    if unit == "s":
        return value, value
    if unit == "m":
        return value * 60 - 30, value * 60 + 30
    return value * 3600 - 180, value * 3600 + 180


class TestDashboardInABrowser:
    def test_what_an_operator_and_a_tenant_see(
        self, dashboard_stack: StartStack, browser: Any
    ) -> None:
        from selenium.webdriver.common.by import By

        urls = dashboard_stack(TOKENS, [TIGHT, LOOSE])
        adm, dash = urls["admission"], urls["dashboard"]
        spent_at = time.monotonic()
        spend(adm, "a", 5)  # tight|tenant=a: 5 of 5, exhausted
        spend(adm, "b", 2)  # tight|tenant=b: 2 of 5
        assert admit(adm, "b", requests=4).status_code == 429  # b refused once
        sign_in(browser, dash, "tok-ops")

        top = wait_for(
            "tight|tenant=a at the top, 5 of 5",
            lambda: (
                (r := rows(browser))
                and r[0]["key"] == "tight|tenant=a"
                and "5 + 0 / 5 requests (100%)" in r[0]["usage"]
                and r
            ),
        )
        assert top[0]["window"] == "5m"
        # Exhausted by requests sent just now: one fits again when their 10 s bucket leaves
        # the 5 m window, at most 310 s from the spend and at least 290 s minus what passed
        # since (the cell rounds to whole minutes from 120 s on).
        low, high = shown_seconds(top[0]["retry"])
        since = time.monotonic() - spent_at
        assert low <= 310 and high >= 290 - since - 1, (top[0]["retry"], since)
        assert top[1]["key"] == "tight|tenant=b" and "2 + 0 / 5" in top[1]["usage"]
        assert {r["key"] for r in top} >= {f"loose-tokens|tenant=a|api_key={key_id('a-key-1')}"}

        # The page is not reloaded from here on: a marker set now must survive.
        browser.execute_script("window.__notReloaded = true")
        refused = admit(adm, "a")
        assert refused.status_code == 429
        wait_for(
            "tenant a's refusal in the feed",
            lambda: "refused a by tight" in text_of(browser, "#refusals li"),
        )
        wait_for(
            "the reject decisions counted",
            lambda: text_of(browser, '#decisions tr[data-kind="reject"]').split()[1:2] == ["2"],
        )
        wait_for(
            "tenant a's exhausted alert",
            lambda: browser.find_elements(
                By.CSS_SELECTOR, '#alerts li[data-kind="exhausted"][data-key="tight|tenant=a"]'
            ),
        )
        assert browser.execute_script("return window.__notReloaded === true")

        browser.find_element(By.CSS_SELECTOR, '#budgets tr[data-key="tight|tenant=a"]').click()
        wait_for(
            "the window chart of tight|tenant=a with its limit and a refusal mark",
            lambda: (
                browser.find_elements(By.CSS_SELECTOR, "#chart svg .refusal-mark")
                and browser.find_elements(By.CSS_SELECTOR, "#chart svg .limit")
            ),
        )
        assert browser.find_element(By.ID, "key-name").text == "tight|tenant=a"
        time.sleep(1.0)  # one more poll so every panel shows the same moment
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(SCREENSHOT))

        sign_in(browser, dash, "tok-a")
        wait_for("tenant a's rows", lambda: rows(browser))
        wait_for("tenant a's alerts", lambda: text_of(browser, "#alerts li"))
        seen = {r["key"] for r in rows(browser)}
        assert seen == {"tight|tenant=a", f"loose-tokens|tenant=a|api_key={key_id('a-key-1')}"}
        page = browser.find_element(By.TAG_NAME, "body").text + browser.page_source
        assert "tenant=b" not in page and "refused b" not in page
        assert "operators only" in text_of(browser, "#metrics-note")
