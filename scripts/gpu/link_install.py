"""Install this checkout the way `pip install --no-deps -e .` does, without pip.

On the offline H200 host the editable pip install took ~70 s of every device
call (a 30-minute budget); this takes well under a second. It writes into the
interpreter's site-packages (the directory pip would use):

* a finder module plus a ``.pth`` line that installs it, mapping the two
  packages of pyproject.toml's ``[tool.setuptools.package-dir]`` onto this
  checkout (``sglang_replayssm`` -> ``sglang_replayssm/``,
  ``sglang_replayssm.kernels`` -> ``kernels/``), as setuptools' editable
  finder does;
* a ``.dist-info`` with METADATA and pyproject's entry points, so that
  ``importlib.metadata`` (SGLang's plugin loader, in the launcher and in every
  spawned scheduler process) finds ``sglang.srt.plugins``;
* the ``sglang-replayssm`` console script into ``--bin-dir``.

Usage: python3 scripts/gpu/link_install.py [--bin-dir DIR] [--site-dir DIR]
(--site-dir: write there instead, for a directory that site.addsitedir
processes; tests/test_link_install.py)
"""
from __future__ import annotations

import argparse
import os
import site
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FINDER = "_sglang_replayssm_link_finder"

FINDER_SOURCE = '''\
"""Written by scripts/gpu/link_install.py: maps {packages} onto a checkout."""
import importlib.machinery
import importlib.util
import sys

PACKAGES = {packages!r}


class _LinkFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        src = PACKAGES.get(name)
        if src is None:
            return None
        return importlib.util.spec_from_file_location(
            name, src + "/__init__.py", submodule_search_locations=[src])


if not any(f is _LinkFinder or getattr(f, "__name__", "") == "_LinkFinder"
           for f in sys.meta_path):
    sys.meta_path.append(_LinkFinder)
'''


def site_packages() -> Path:
    """pip's target (purelib) when the interpreter processes its .pth files at
    startup, else the first writable directory that it does, else the user
    site."""
    dirs = site.getsitepackages()
    purelib = sysconfig.get_paths()["purelib"]
    for d in ([purelib] if purelib in dirs else []) + dirs:
        if os.path.isdir(d) and os.access(d, os.W_OK):
            return Path(d)
    user = Path(site.getusersitepackages())
    user.mkdir(parents=True, exist_ok=True)
    return user


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", default=None, help="where to write the console script")
    ap.add_argument("--site-dir", default=None,
                    help="install into this directory instead of site-packages")
    args = ap.parse_args()

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    name, version = project["name"], project["version"]
    dist_name = name.replace("-", "_")
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    packages = {pkg: str(ROOT / rel) for pkg, rel in package_dir.items()}

    sp = Path(args.site_dir) if args.site_dir else site_packages()
    sp.mkdir(parents=True, exist_ok=True)
    # a previous pip or link install of this project would register its entry
    # point twice
    for old in list(sp.glob(f"{dist_name}-*.dist-info")) + list(sp.glob(f"__editable__*{dist_name}*")):
        if old.is_dir():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        else:
            old.unlink()

    (sp / f"{FINDER}.py").write_text(FINDER_SOURCE.format(packages=packages))
    (sp / f"{FINDER}.pth").write_text(f"import {FINDER}\n")

    info = sp / f"{dist_name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("link_install\n")
    lines = []
    for group, eps in [("console_scripts", project.get("scripts", {})),
                       *project.get("entry-points", {}).items()]:
        if eps:
            lines.append(f"[{group}]")
            lines += [f"{k} = {v}" for k, v in eps.items()]
            lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    (info / "RECORD").write_text("")

    if args.bin_dir:
        bin_dir = Path(args.bin_dir)
        bin_dir.mkdir(parents=True, exist_ok=True)
        for script, target in project.get("scripts", {}).items():
            mod, func = target.split(":")
            exe = bin_dir / script
            exe.write_text(f"#!{sys.executable}\nimport sys\nfrom {mod} import {func}\n"
                           f"sys.exit({func}())\n")
            exe.chmod(0o755)
    print(f"[link_install] {name} {version} -> {sp} ({', '.join(packages)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
