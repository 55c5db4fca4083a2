"""scripts/gpu/link_install.py (the device calls' pip-free install): the
package and its kernels subpackage import from the checkout, and SGLang's
plugin group lists our entry point exactly once, also after a reinstall."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "link_install.py"

PROBE = """
import json, site, sys
site.addsitedir(sys.argv[1])
from importlib.metadata import entry_points, version
import sglang_replayssm, sglang_replayssm.kernels as k
print(json.dumps(dict(
    plugins=[e.value for e in entry_points(group="sglang.srt.plugins")],
    scripts=[e.value for e in entry_points(group="console_scripts")
             if e.name == "sglang-replayssm"],
    version=version("sglang-replayssm"), pkg=sglang_replayssm.__file__, kernels=k.__file__)))
"""


def test_link_install_maps_the_layout_and_registers_the_plugin_once(tmp_path):
    site_dir, bin_dir = tmp_path / "site", tmp_path / "bin"
    for _ in range(2):  # a second install replaces the first
        subprocess.run([sys.executable, str(SCRIPT), "--site-dir", str(site_dir),
                        "--bin-dir", str(bin_dir)], check=True, capture_output=True)
    # -S: no site-packages, so only the link install can provide the package
    # (this interpreter's own editable install would otherwise answer); the cwd
    # is outside the checkout, whose sglang_replayssm/ would shadow it too
    out = subprocess.run([sys.executable, "-S", "-c", PROBE, str(site_dir)], cwd=tmp_path,
                         check=True, capture_output=True, text=True).stdout
    got = json.loads(out)
    import sglang_replayssm
    assert got["plugins"] == ["sglang_replayssm.plugin:register"]
    assert got["scripts"] == ["sglang_replayssm.cli:main"]
    assert got["version"] == sglang_replayssm.__version__
    assert Path(got["pkg"]) == ROOT / "sglang_replayssm" / "__init__.py"
    assert Path(got["kernels"]) == ROOT / "kernels" / "__init__.py"
    script = (bin_dir / "sglang-replayssm").read_text()
    assert script.startswith(f"#!{sys.executable}\n") and "from sglang_replayssm.cli import main" in script
