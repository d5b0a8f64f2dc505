"""Sequences as a model reads them: turns packed into chains (a conversation's turns, or any sequences that
extend one another), a prompt shared by its responses as a tree, the padded inputs of a batch of either, and
micro-batches bounded in padded tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedSequence:
    """Token ids fed to the model once, and where each sample's response sits in them.

    A chain by default (each token follows the one before). With ``parents`` the tokens form a tree: each
    token attends to its ancestors only and sits at its depth, so several responses to one prompt (the
    candidates of a state) share one encoding of it; every response token gets exactly the log-prob it has
    as its own sequence."""

    input_ids: list[int]
    spans: list[tuple[int, int]]  # (sample index, position of the sample's first response token)
    parents: list[int] | None = None  # per token, the position it follows (-1: the first token)

    def predecessors(self, start: int, n: int) -> list[int]:
        """Positions whose outputs predict the ``n`` tokens from ``start``."""
        if self.parents is None:
            return list(range(start - 1, start - 1 + n))
        return [self.parents[p] for p in range(start, start + n)]


def shared_prompt(prompt: list[int], responses: list[tuple[int, list[int]]]) -> PackedSequence:
    """One prompt and several (sample index, response) continuations of it as a tree: the prompt once, then
    each response after it, attending to the prompt and to itself. A single response is a plain chain."""
    if len(responses) == 1:
        index, response = responses[0]
        return PackedSequence(list(prompt) + list(response), [(index, len(prompt))])
    ids, parents, spans = list(prompt), list(range(-1, len(prompt) - 1)), []
    for index, response in responses:
        spans.append((index, len(ids)))
        parents += [len(prompt) - 1, *range(len(ids), len(ids) + len(response) - 1)][: len(response)]
        ids += response
    return PackedSequence(ids, spans, parents)


def prefix_chains(sequences: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """The sequences in groups whose members are all prefixes of the group's longest (a conversation's turns: each
    [history; response] is extended by the next turn's prompt), as (the longest, member indices). Under causal
    attention one pass over the longest gives every member's hidden states at their own positions."""
    chains: list[tuple[list[int], list[int]]] = []
    # in lexicographic order a prefix comes first, and whatever sorts between it and its extension shares it
    for i in sorted(range(len(sequences)), key=lambda i: sequences[i]):
        if chains and sequences[i][: len(chains[-1][0])] == chains[-1][0]:
            chains[-1] = (sequences[i], chains[-1][1] + [i])
        else:
            chains.append((sequences[i], [i]))
    return chains


def model_inputs(
    sequences: list[PackedSequence], pad_id: int, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Keyword inputs of a decoder for a right-padded batch: a padding mask for chains; for trees, an
    additive [batch, 1, L, L] mask (a token sees its ancestors) and each token's depth as its position."""
    width = max(len(s.input_ids) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for b, seq in enumerate(sequences):
        ids[b, : len(seq.input_ids)] = torch.tensor(seq.input_ids)
    if all(s.parents is None for s in sequences):
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for b, seq in enumerate(sequences):
            mask[b, : len(seq.input_ids)] = 1
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    sees = torch.eye(width, dtype=torch.bool).repeat(len(sequences), 1, 1)  # padding rows see themselves
    positions = torch.zeros((len(sequences), width), dtype=torch.long)
    for b, seq in enumerate(sequences):
        if seq.parents is None:
            n = len(seq.input_ids)
            sees[b, :n, :n] = torch.ones((n, n), dtype=torch.bool).tril()
            positions[b, :n] = torch.arange(n)
            continue
        for k, parent in enumerate(seq.parents):
            if parent >= 0:
                sees[b, k] |= sees[b, parent]
                positions[b, k] = positions[b, parent] + 1
    mask = torch.zeros(sees.shape, dtype=dtype).masked_fill_(~sees, torch.finfo(dtype).min)
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.unsqueeze(1).to(device),
        "position_ids": positions.to(device),
    }


def token_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive index groups whose padded size (longest x count) stays within ``budget`` tokens; a longer
    sequence goes alone."""
    out: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        grown = max(longest, n)
        if out and grown * (len(out[-1]) + 1) <= budget:
            out[-1].append(i)
            longest = grown
        else:
            out.append([i])
            longest = n
    return out
