"""scripts/provenance.py: a benchmark record names the code that ran, also
from a copy of the tree whose .git is stale (the GPU host's)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import provenance as pv  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "one")
    return tmp_path


def test_clean_tree_is_its_commit_and_ignored_files_do_not_count(repo):
    (repo / "ignored").mkdir()
    (repo / "ignored" / "bundle.bin").write_bytes(b"\0" * 10)
    head = _git(repo, "rev-parse", "HEAD")
    assert pv.provenance(str(repo)) == {"git_commit": head,
                                        "git_tree": _git(repo, "rev-parse", "HEAD^{tree}")}
    assert _git(repo, "status", "--porcelain") == ""  # the checkout's index untouched


def test_a_stale_copy_records_a_tree_that_resolves_here(repo, tmp_path_factory):
    stale = tmp_path_factory.mktemp("device") / "copy"
    shutil.copytree(repo, stale)  # .git as of commit one
    (repo / "a.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 3\n")  # untracked files travel and count
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "two")
    two = _git(repo, "rev-parse", "HEAD")
    for name in ("a.py", "new.py"):  # the device copy: new files, old .git
        shutil.copy(repo / name, stale / name)
    rec = pv.provenance(str(stale))
    assert rec["git_commit"] == _git(stale, "rev-parse", "HEAD") + "-dirty"
    assert pv.commit_of_tree(str(repo), rec["git_tree"]) == two
    assert pv.git_commit(str(repo)) == two


def test_git_commit_from_the_environment_wins(repo, monkeypatch):
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    assert pv.provenance(str(repo))["git_commit"] == "abc1234"
    assert pv.provenance(str(repo))["git_tree"] == _git(repo, "rev-parse", "HEAD^{tree}")
