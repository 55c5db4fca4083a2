"""Which code a benchmark record came from, for scripts/bench_*.py.

The GPU host gets a copy of the working tree whose .git may be stale (the
device tool copies the files, not always a fresh repository): `git rev-parse
HEAD` there can name an older commit. So a record carries, besides the
commit, the git tree object of the working tree as it ran (tracked and
untracked-not-ignored files, hashed through a temporary index, the checkout's
own index untouched). That hash is the same here and there, so
`python scripts/provenance.py resolve TREE` names the commit here; a tree
that is some commit's is recorded as that commit.

    git_commit(root) -> "<sha>" | "<sha>-dirty" | GIT_COMMIT from the environment
    git_tree(root)   -> "<tree sha>" | "unknown"
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def _git(root: str, *args: str, env: dict | None = None) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                          check=True, timeout=120, env=env).stdout.strip()


def git_tree(root: str) -> str:
    """The tree object of the working tree as it is."""
    try:
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(d, "index"))
            _git(root, "add", "-A", ".", env=env)
            return _git(root, "write-tree", env=env)
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def commit_of_tree(root: str, tree: str) -> str | None:
    """The newest commit (any branch) whose tree is `tree`, if any."""
    try:
        for line in _git(root, "log", "--all", "--format=%H %T").splitlines():
            sha, _, t = line.partition(" ")
            if t == tree:
                return sha
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def git_commit(root: str, tree: str | None = None) -> str:
    """GIT_COMMIT if set; else the commit whose tree the working tree is;
    else HEAD + "-dirty" (then only the record's git_tree says what ran).
    Where the tree cannot be hashed (a read-only .git), HEAD and
    `git status` decide, as before there was a tree."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    tree = tree or git_tree(root)
    if tree != "unknown":
        sha = commit_of_tree(root, tree)
        if sha:
            return sha
    try:
        head = _git(root, "rev-parse", "HEAD")
        dirty = tree != "unknown" or _git(root, "status", "--porcelain")
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(root: str) -> dict:
    tree = git_tree(root)
    return {"git_commit": git_commit(root, tree), "git_tree": tree}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "resolve":
        raise SystemExit("usage: python scripts/provenance.py resolve TREE_SHA")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(commit_of_tree(here, sys.argv[2]) or "no commit here has that tree")
