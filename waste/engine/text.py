"""Text in and out for `waste run`: `--prompt TEXT` and `--chat TEXT` through the container's tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

from waste.tokenizer import Tokenizer

# Any system text: the template renders it, and the user's turn is what follows it.
_SYSTEM_PLACEHOLDER = {"role": "system", "content": "-"}


def chat_turn_ids(tokenizer: Tokenizer, user_text: str, *, continuing: bool, last_token: int | None) -> list[int]:
    """Ids of one user turn and the assistant's opening, rendered by the chat template.

    A new conversation gets the whole template (its default system turn included). A session
    that already holds a conversation gets only the new turn: the template's rendering of
    [system, user] past that of [system]; when the previous reply was cut off before its end
    token, that token is fed first so the turns stay well formed.
    """
    user = {"role": "user", "content": user_text}
    if not continuing:
        return tokenizer.encode(tokenizer.apply_chat_template([user]))
    before = tokenizer.apply_chat_template([_SYSTEM_PLACEHOLDER], add_generation_prompt=False)
    both = tokenizer.apply_chat_template([_SYSTEM_PLACEHOLDER, user])
    ids = tokenizer.encode(both[len(before):])
    stops = tokenizer.stop_ids()
    end = tokenizer.special_ids.get("<|im_end|>")
    if last_token is not None and last_token not in stops and end is not None:
        ids = [end] + ids
    return ids


def text_printer(tokenizer: Tokenizer, out: TextIO) -> tuple[Callable[[int], bool], Callable[[], None]]:
    """(on_token, finish): on_token writes each token's text as it comes and says whether to stop
    (an end-of-turn token, which is not printed); finish flushes held-back bytes and ends the line."""
    stream = tokenizer.stream()
    stops = tokenizer.stop_ids()

    def on_token(token: int) -> bool:
        if token in stops:
            return True
        out.write(stream.push(token))
        out.flush()
        return False

    def finish() -> None:
        out.write(stream.flush() + "\n")
        out.flush()

    return on_token, finish
