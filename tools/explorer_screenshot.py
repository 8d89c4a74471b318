"""Screenshot of the explorer page for the docs: docs/images/explorer.png.

The 50-step Elman RNN of examples/models after backward, shown as declared (the page's default);
the page searched for ``Tanh:1@37`` (its iteration unfolded, the node selected) and the
gradient-through-time chart hovered at t=37. Needs chromium, chromedriver and selenium.

    PYTHONPATH=$PWD python tools/explorer_screenshot.py [OUT.png]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "models"))

from vgraph.render import explore_script_result  # noqa: E402


def main() -> None:
    import elman_rnn
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "images" / "explorer.png"
    g, feed, outs = elman_rnn.build(steps=50)
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--window-size=1400,960",
        "--hide-scrollbars",
    ):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            page = Path(tmp) / "explorer.html"
            explore_script_result(g, feed, outs, page)
            driver.get(page.as_uri())
            box = driver.find_element(By.ID, "vg-search-input")
            box.send_keys("Tanh:1@37", Keys.ENTER)  # selecting it charts its own |grad| by iteration:
            Select(driver.find_element(By.ID, "vg-series")).select_by_index(0)  # back to Wx's
            hit = driver.find_element(By.ID, "vg-chart-hit")
            w = hit.rect["width"]
            ActionChains(driver).move_to_element_with_offset(hit, int(-w / 2 + w * 37 / 49), 0).perform()
            driver.save_screenshot(str(out))
    finally:
        driver.quit()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
