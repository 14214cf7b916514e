"""Headless Chromium for the report tests: load a page offline, read what it rendered, take a screenshot.

Every host name resolves to nothing, so a page that reaches for the network renders incompletely.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PROBE = """<script>
setTimeout(() => {
  const texts = [];
  const walk = (n) => {
    if (n.shadowRoot) walk(n.shadowRoot);
    for (const c of n.childNodes) { if (c.nodeType === 3) texts.push(c.textContent.trim()); else walk(c); }
  };
  walk(document.body);
  const broken = [...document.images].filter((i) => !i.complete || i.naturalWidth === 0).length;
  const pre = document.createElement('pre');
  pre.id = 'probe';
  pre.textContent = 'broken-images=' + broken + '\\n' + texts.filter(Boolean).join('\\n');
  document.body.appendChild(pre);
}, 1500);
</script>"""


def chromium() -> str:
    """The browser binary, or a skip naming how to install it."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium not installed (`apt-get install -y chromium`): headless page test not run")
    return found


def _run(page: Path, profile: Path, *extra: str, fragment: str = "") -> str:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
           "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=10000", *extra,
           page.resolve().as_uri() + fragment]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def rendered_text(page: Path, tmp: Path, fragment: str = "") -> str:
    """The text the page shows once its scripts ran (shadow DOMs included), first line the broken images."""
    probed = page.with_name(f"probe-{page.name}")
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = _run(probed, tmp / "profile-dom", "--dump-dom", fragment=fragment)
    start = dom.find('<pre id="probe">')
    assert start >= 0, f"the page's scripts did not run: {dom[-2000:]}"
    return dom[start + len('<pre id="probe">'):dom.index("</pre>", start)]


def screenshot(page: Path, out: Path, tmp: Path, size: str = "1280,800", fragment: str = "") -> Path:
    _run(page, tmp / "profile-shot", f"--window-size={size}", f"--screenshot={out}", fragment=fragment)
    assert out.is_file(), f"chromium wrote no screenshot to {out}"
    return out
