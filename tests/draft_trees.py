"""Random draft trees for the tree-verify tests of both kernel families."""
from __future__ import annotations

import torch


def random_tree(gen: torch.Generator, T: int) -> list[int]:
    """parents[j] in [-1, j): draft 0 follows the committed history, each
    later draft a uniformly chosen earlier one, or (one in four) the history
    too, so that a window may hold several trees."""
    parents = [-1]
    for j in range(1, T):
        fresh = int(torch.randint(0, 4, (1,), generator=gen)) == 0
        parents.append(-1 if fresh else int(torch.randint(0, j, (1,), generator=gen)))
    return parents


def as_sglang_parents(trees: list[list[int]]) -> torch.Tensor:
    """The trees as SGLang's ``retrieve_parent_token`` holds them: int64,
    entry 0 never written (a value no kernel may follow, here 99)."""
    parents = torch.tensor(trees, dtype=torch.int64)
    parents[:, 0] = 99
    return parents


def path_to(parents: list[int], node: int) -> list[int]:
    """The window indices from the tree's first draft down to ``node``."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def random_paths(gen: torch.Generator, trees: list[list[int]], T: int):
    """Per row a random accepted path (to a uniformly chosen draft) as the
    int32 [rows, T] ``path`` and [rows] ``accepted`` that accept_path takes."""
    path = torch.zeros(len(trees), T, dtype=torch.int32)
    accepted = torch.zeros(len(trees), dtype=torch.int32)
    for r, parents in enumerate(trees):
        p = path_to(parents, int(torch.randint(0, T, (1,), generator=gen)))
        path[r, :len(p)] = torch.tensor(p, dtype=torch.int32)
        accepted[r] = len(p)
    return path, accepted
