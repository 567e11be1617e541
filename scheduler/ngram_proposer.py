"""NgramProposer: speculative decoding's prompt lookup, draft tokens from a request's own tokens (plain ints).

The longest suffix of the tokens, from max_len down to min_len tokens, that occurred earlier: the tokens that followed
its latest earlier occurrence are the draft. Repetitive tasks (summarise, edit or quote a given text, code) draft
well; open generation rarely finds a match and then decodes one token a pass as without speculation.
"""

from __future__ import annotations

# Only the latest tokens are searched: a pass's proposal stays cheap in pure Python at any context length.
MAX_LOOKBACK = 4096


class NgramProposer:
    def __init__(self, min_len: int, max_len: int, num_draft_tokens: int):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len} and {max_len}")
        self.min_len, self.max_len = min_len, max_len
        self.num_draft_tokens = num_draft_tokens

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(num_draft_tokens, max_tokens) tokens to follow token_ids; [] when no suffix recurs."""
        limit = self.num_draft_tokens if max_tokens is None else min(self.num_draft_tokens, max_tokens)
        if limit <= 0:
            return []
        tokens = token_ids[-MAX_LOOKBACK:]
        num_tokens = len(tokens)
        for length in range(min(self.max_len, num_tokens - 1), self.min_len - 1, -1):
            suffix = tokens[num_tokens - length :]
            # latest start first; the occurrence must end before the suffix itself does, so something follows it
            for start in range(num_tokens - length - 1, -1, -1):
                if tokens[start + length - 1] == suffix[-1] and tokens[start : start + length] == suffix:
                    follow = start + length
                    return tokens[follow : follow + limit]
        return []
