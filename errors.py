"""The one exception type for problems a user can cause and fix."""


class FastARError(Exception):
    """A user-facing error: the message says what is wrong and what to do about it."""


class FastARWarning(UserWarning):
    """Something FastAR had to guess: the message says what it chose and how to choose otherwise."""


def check_choice(kind: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; else a FastARError that lists them."""
    if value not in choices:
        raise FastARError(f"unknown {kind} '{value}': choose one of {', '.join(choices)}")
    return value
