"""Grammar-constrained rows (``rollout.constrained: grammar``; docs/algorithms.md 1.2): the token mask of a
:class:`~repertory.envs.grammar.TurnGrammar` at each step, from llguidance.

Under a grammar the policy *is* the masked distribution: a sampled token's log-prob is log softmax(z / T) over
the tokens the mask allows. The sampler masks each step of a row (:class:`GrammarRow`); the learner replays the
grammar over the sampled tokens (:meth:`GrammarMasks.replay`) and gets the same masks, so both score the same
policy. Beside the grammar, a row's talk (the text before its first ``<``) is kept within the grammar's
``talk_bytes``: a token whose talk bytes would pass it is masked too.
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from repertory.envs.grammar import TurnGrammar
from repertory.types import RepertoryError


class GrammarMasks:
    """The masks of one tokenizer's grammars. Building one wraps the tokenizer for llguidance (about a second),
    so :func:`grammar_masks` keeps one per tokenizer."""

    def __init__(self, tokenizer: Any, end_of_turn_id: int):
        self.vocab = len(tokenizer)
        self.end_of_turn_id = end_of_turn_id
        self.lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab, eos_token=end_of_turn_id)
        pieces = [self.lltokenizer.decode_bytes([i]) for i in range(self.vocab)]
        self.opens_tag = np.array([b"<" in p for p in pieces])
        self.talk_bytes = np.array([p.find(b"<") if b"<" in p else len(p) for p in pieces])
        """Each token's bytes before its first ``<``: what it adds to the talk."""

    def start(self, grammar: TurnGrammar) -> GrammarRow:
        """A row at its first token."""
        return GrammarRow(self, grammar)

    def replay(self, recorded: str, tokens: list[int], width: int) -> torch.Tensor:
        """The allowed tokens before each of ``tokens`` (a bool [len(tokens), width] mask), as the sampler had
        them under the grammar a turn ``recorded`` (``TurnGrammar.dumps``)."""
        row, out = self.start(TurnGrammar.loads(recorded)), torch.zeros((len(tokens), width), dtype=torch.bool)
        for j, token in enumerate(tokens):
            out[j] = row.allowed(width)
            row.advance(token)
        return out

    def misfit(self, recorded: str, tokens: list[int]) -> str | None:
        """Why ``tokens`` could not have been sampled under the grammar ``recorded``, or None where they could:
        every token allowed by its step's mask (the grammar's tokens within the talk bound), the end-of-turn
        token last and only there."""
        row = self.start(TurnGrammar.loads(recorded))
        for j, token in enumerate(tokens):
            if j and tokens[j - 1] == self.end_of_turn_id:
                return f"token {token} at position {j} follows the end-of-turn token"
            if not row.allowed(self.vocab)[token]:
                return f"token {token} at position {j} is outside its step's mask (the grammar within its talk bound)"
            row.advance(token)
        if not tokens or tokens[-1] != self.end_of_turn_id:
            return "the response stops before its grammar ends (no end-of-turn token)"
        return None


_MASKS: dict[int, tuple[Any, GrammarMasks]] = {}


def grammar_masks(tokenizer: Any, end_of_turn_id: int) -> GrammarMasks:
    """The (cached) :class:`GrammarMasks` of ``tokenizer``."""
    key = id(tokenizer)
    if key not in _MASKS or _MASKS[key][1].end_of_turn_id != end_of_turn_id:
        _MASKS[key] = (tokenizer, GrammarMasks(tokenizer, end_of_turn_id))  # the tokenizer kept: its id stays its
    return _MASKS[key][1]


class GrammarRow:
    """One row's grammar state: ``allowed`` the mask of its next token, ``advance`` after it is drawn."""

    def __init__(self, masks: GrammarMasks, grammar: TurnGrammar):
        self.masks = masks
        self.matcher = llguidance.LLMatcher(masks.lltokenizer, llguidance.grammar_from("lark", grammar.lark))
        self._check("the grammar does not compile")
        self.talk_left = grammar.talk_bytes
        self.talking = True

    def allowed(self, width: int) -> torch.Tensor:
        """The tokens that keep the row within its grammar and its talk bound (bool, [width]: the logits' width,
        which may pad the vocabulary; padding is never allowed)."""
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(packed, bitorder="little")[: self.masks.vocab].view(np.bool_)
        self._check("the grammar has no next token")
        if not allowed.any():
            raise RepertoryError("the grammar allows no token here (an impossible state)")
        if self.talking:
            fits = allowed & (self.masks.talk_bytes <= self.talk_left)
            if not fits.any():  # a character split over tokens is finished, by its shortest end
                fits = allowed & (self.masks.talk_bytes == self.masks.talk_bytes[allowed].min())
            allowed = fits
        out = torch.zeros(width, dtype=torch.bool)
        out[: self.masks.vocab] = torch.from_numpy(allowed)
        return out

    def advance(self, token: int) -> None:
        """Take ``token`` (one that :meth:`allowed` allowed)."""
        if not self.matcher.consume_token(token):
            self._check(f"token {token} is outside the grammar")
        if self.talking:
            self.talking = not bool(self.masks.opens_tag[token])
            self.talk_left -= int(self.masks.talk_bytes[token])

    def _check(self, what: str) -> None:
        if self.matcher.is_error():
            raise RepertoryError(f"{what}: {self.matcher.get_error()}")
