"""Token trees: a draft's main chain and its alternative paths, verified in one pass.

A tree is given by its root-to-leaf *paths*, all starting after the request's last
context token (the *root*). A path's leading tokens shared with an earlier path are
that path's *nodes*: each node is a row of the pass once. An alternative path gets a
batch entry of its own (a *branch*) whose rows are only its own nodes; the keys and
values of its shared prefix are copied from the earlier entries' rows
(``BatchEntry.shared``), and its blocks are the request's committed ones, shared, plus a
copy-on-write copy of the partly filled block and fresh blocks after it.

A node is named by ``(entry index, index in that entry's token_ids)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdecode.backends.base import BatchEntry
from fastdecode.drafters.base import Draft
from fastdecode.engine.request import Request
from fastdecode.kv.cache import BlockPool, PagedKVCache

Node = tuple[int, int]  # (entry index, index in its token_ids)


def tree_prefix(path: Sequence[int], earlier: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(j, i): the most leading tokens ``path`` shares with one of the ``earlier`` paths of a
    token tree (all from the same root), and which one (the first on a tie; (0, 0) when none).

    >>> tree_prefix([1, 2, 3], [[1, 5], [1, 2, 9]])
    (2, 1)
    """
    best = (0, 0)
    for i, other in enumerate(earlier):
        j = 0
        while j < min(len(path), len(other)) and path[j] == other[j]:
            j += 1
        if j > best[0]:
            best = (j, i)
    return best


def tree_nodes(draft: Draft) -> int:
    """The nodes a draft's alternative paths add to its main chain (their tokens not on an earlier path)."""
    count, earlier = 0, [draft.tokens]
    for alt in draft.alternatives:
        count += len(alt) - tree_prefix(alt, earlier)[0]
        earlier.append(alt)
    return count


def branch_entry(cache: PagedKVCache, request: Request, alt: list[int], prefix: list[Node]) -> BatchEntry:
    """A batch entry for an alternative path whose first ``len(prefix)`` nodes (the
    last context token, then ``alt``'s first tokens) are rows of earlier entries,
    ``prefix`` naming them: the request's committed blocks shared, the partly filled
    block holding its last token copied (copy-on-write), fresh blocks after it; the
    pass copies the prefix's keys and values in (``BatchEntry.shared``) and computes
    only the path's own nodes."""
    pool, B = cache.pool, cache.pool.block_size
    start = len(request.context) - 1
    shared = request.table.blocks[: start // B]
    pool.share(shared)
    private = pool.allocate(pool.blocks_for(start + 1 + len(alt)) - len(shared))
    if start % B:
        cache.copy_block(request.table.blocks[start // B], private[0])
    own = alt[len(prefix) - 1 :]
    return BatchEntry(own, start + len(prefix), [*shared, *private], len(own), tuple(prefix))


def add_branches(
    cache: PagedKVCache, scheduled: list[Request], drafts: dict[str, Draft], entries: list[BatchEntry]
) -> dict[str, list[list[Node]]]:
    """Append each scheduled request's alternative paths to ``entries``, after every main
    entry (``entries[e]`` is ``scheduled[e]``'s); returns, per request with alternatives,
    each path's nodes, root first: the main chain's, then each alternative's."""
    path_rows: dict[str, list[list[Node]]] = {}
    for e, request in enumerate(scheduled):
        draft = None if request.prefilling else drafts[request.request_id]
        if draft is None or not draft.alternatives:
            continue
        paths = [[(e, t) for t in range(len(draft) + 1)]]
        for alt in draft.alternatives:
            j, src = tree_prefix(alt, [draft.tokens, *draft.alternatives[: len(paths) - 1]])
            branch = branch_entry(cache, request, alt, paths[src][: j + 1])
            paths.append([*paths[src][: j + 1], *((len(entries), t) for t in range(len(alt) - j))])
            entries.append(branch)
        path_rows[request.request_id] = paths
    return path_rows


def branch_logits(
    paths: list[list[Node]], entries: list[BatchEntry], first_logit: list[int], logits: torch.Tensor
) -> list[tuple[BatchEntry, torch.Tensor]]:
    """Each alternative path's branch entry and its nodes' logits, [path length + 1, vocab_size]
    (``paths`` as ``add_branches`` returns them, main chain first; ``first_logit[e]``: the row
    of ``logits`` where entry e's start, every row of a decoding entry having logits)."""
    branches = []
    for path in paths[1:]:
        index = torch.tensor([first_logit[pe] + t for pe, t in path], device=logits.device)
        branches.append((entries[path[-1][0]], logits[index]))
    return branches


def keep_path(
    pool: BlockPool, request: Request, branches: Sequence[tuple[BatchEntry, torch.Tensor]], kept: BatchEntry | None
) -> None:
    """Free the blocks of every branch but ``kept``; a kept branch's blocks become the
    request's (the blocks it shares with the request were held by both: freeing the
    request's old table leaves one hold)."""
    for branch, _ in branches:
        if branch is not kept:
            pool.free(branch.block_table, reuse_first=True)
    if kept is not None:
        pool.free(request.table.blocks, reuse_first=True)
        request.table.blocks = list(kept.block_table)
